"""A ModernBERT backbone in fine-tuning (bertdist/finetune/modernbert_heads.py, chosen through
bertdist/export/encoders.py), from a tiny transformers ``ModernBertForMaskedLM`` directory with a
byte-level BPE tokenizer.json (tests/export/tiny_modernbert.py):

- every head kind is transformers' ``ModernBertFor<Task>`` key for key, with its logits (fp32, 1e-5),
  for both ``classifier_pooling`` modes;
- `finetune` on SST-2-format rows trains (the loss falls), saves a ModernBertForSequenceClassification
  that transformers loads with every key and whose dev logits equal ours; from the HF directory and
  from the bertdist torch-format directory made of it.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bertdist.export.encoders import family_of
from bertdist.export.sources import load_pretrained, write_torch_dir
from bertdist.finetune.heads import hf_architecture, task_model
from bertdist.finetune.modernbert_heads import ModernBertForTask
from tests.export.tiny_modernbert import CORPUS, write_hf_modernbert

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return write_hf_modernbert(tmp_path_factory.mktemp("modernbert"))


@pytest.fixture(scope="module")
def sst2(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("SST-2")
    rows = [(s, 1) for s in CORPUS[:8]] + [(s, 0) for s in CORPUS[8:16]]
    (d / "train.tsv").write_text("sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in rows))
    (d / "dev.tsv").write_text("sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in rows[::3]))
    return d


def _batch(tok, kind: str):
    """A right-padded batch of texts of different lengths (choice: [2, 4, S])."""
    texts = ["a great film", "The man is cooking dinner in the afternoon.", "truly awful", "Who wrote the letter?"]
    if kind == "choice":
        enc = tok([t for _ in range(2) for t in texts], padding=True, return_tensors="pt")
        return {k: v.view(2, 4, -1) for k, v in enc.items()}
    return dict(tok(texts, padding=True, return_tensors="pt"))


HF_CLASS = {"classification": "ModernBertForSequenceClassification", "regression": "ModernBertForSequenceClassification",
            "token": "ModernBertForTokenClassification", "span": "ModernBertForQuestionAnswering",
            "choice": "ModernBertForMultipleChoice"}


@pytest.mark.parametrize("kind,pooling", [("classification", "cls"), ("classification", "mean"), ("regression", "cls"),
                                          ("token", "cls"), ("span", "cls"), ("choice", "cls"), ("choice", "mean")])
def test_each_head_is_transformers_modernbert_for_task(hf_dir, tmp_path, kind, pooling):
    from bertdist.export.tokenizer import fast_tokenizer

    w = load_pretrained(hf_dir)
    family = family_of(w.config)
    torch.manual_seed(1)
    ours = task_model(w.config, kind, 3, pooling=pooling)
    assert isinstance(ours, ModernBertForTask) and hf_architecture(kind, w.config) == HF_CLASS[kind]
    ours.load_backbone(w.state_dict)
    with torch.no_grad():  # a head far from its init, so a misplaced tensor shows
        for p in ours.head.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    conf = {**family.hf_config(w.config, [HF_CLASS[kind]]), **family.task_config(ours),
            "num_labels": {"regression": 1, "span": 2}.get(kind, 3)}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in ours.state_dict().items()}, str(tmp_path / "model.safetensors"))
    hf, info = getattr(transformers, HF_CLASS[kind]).from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    batch = _batch(fast_tokenizer(hf_dir / "tokenizer.json"), kind)
    with torch.no_grad():
        logits, _ = ours.eval()(batch)
        out = hf.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    if kind == "span":
        theirs = torch.stack([out.start_logits, out.end_logits], -1)
    else:
        theirs = out.logits.squeeze(-1) if kind == "regression" else out.logits
    if kind in ("token", "span"):  # padding positions carry no prediction (ours are zeros there)
        real = batch["attention_mask"].bool()
        logits, theirs = logits[real], theirs[real]
    assert logits.shape == theirs.shape
    assert (logits - theirs).abs().max().item() <= 1e-5


def test_training_lowers_the_loss(hf_dir, sst2):
    from bertdist.finetune import FinetuneConfig
    from bertdist.finetune.tasks import make_runner
    from bertdist.finetune.train import collate, resolve_tokenizer

    cfg = FinetuneConfig(task="sst2", checkpoint=str(hf_dir), data=str(sst2), max_seq_length=32)
    w = load_pretrained(hf_dir)
    runner = make_runner("sst2", sst2, resolve_tokenizer(cfg, w), cfg)
    batch = collate(runner.train_features())
    torch.manual_seed(0)
    model = task_model(w.config, runner.kind, runner.num_labels)
    model.load_backbone(w.state_dict)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(30):
        _, loss = model(batch)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert max(losses[-3:]) < 0.25 * losses[0], losses


def test_finetune_decides_attention_backend_auto_at_its_start(hf_dir, sst2, tmp_path, monkeypatch, capsys):
    """A backbone whose config says attention_backend auto (a pretraining run's): fine-tuning gates
    and times the backends for its shapes before training; on CPU, training, that is sdpa."""
    import dataclasses

    from bertdist.finetune import FinetuneConfig, run_finetune

    monkeypatch.setenv("BERTDIST_CACHE_DIR", str(tmp_path / "cache"))
    w = load_pretrained(hf_dir)
    w.config = dataclasses.replace(w.config, attention_backend="auto")
    ckpt = write_torch_dir(tmp_path / "torch", w)
    cfg = FinetuneConfig(task="sst2", checkpoint=str(ckpt), data=str(sst2), output_dir=str(tmp_path / "run"),
                         max_seq_length=32, batch_size=4, max_steps=2, learning_rate=1e-3, progress=False,
                         save_model=False, predict_test=False, tensorboard=False)
    summary = run_finetune(cfg)
    assert summary["kernel_sources"] == {"attention": "sdpa"}
    err = capsys.readouterr().err
    assert "attention_backend: auto chose sdpa: forward + backward of" in err and "batch 4 x seq 32" in err
    assert (tmp_path / "cache" / "kernel_decisions.json").is_file()


@pytest.mark.parametrize("source", ["hf", "torch"])
def test_finetune_saves_a_model_transformers_reproduces(hf_dir, sst2, tmp_path, source):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from bertdist.finetune import FinetuneConfig, run_finetune
    from bertdist.finetune.glue import GLUE_TASKS, read_glue

    ckpt = hf_dir if source == "hf" else write_torch_dir(tmp_path / "torch", load_pretrained(hf_dir))
    out = tmp_path / "run"
    cfg = FinetuneConfig(task="sst2", checkpoint=str(ckpt), data=str(sst2), output_dir=str(out), max_seq_length=32,
                         batch_size=4, max_steps=6, learning_rate=1e-3, progress=False, save_model=True,
                         predict_test=False, tensorboard=False, classifier_pooling="mean")
    summary = run_finetune(cfg)
    assert summary["kernel_sources"] == {"attention": "sdpa"}
    hf, info = AutoModelForSequenceClassification.from_pretrained(out / "model", output_loading_info=True)
    assert type(hf).__name__ == "ModernBertForSequenceClassification"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert hf.config.classifier_pooling == "mean" and hf.config.id2label == {0: "0", 1: "1"}
    tok = AutoTokenizer.from_pretrained(out / "model")
    ex = read_glue(GLUE_TASKS["sst2"], sst2 / "dev.tsv")
    enc = tok([e.text_a for e in ex], padding=True, return_tensors="pt")
    with torch.no_grad():
        theirs = hf.eval()(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
    rows = json.loads((out / "predictions" / "dev.json").read_text())
    ours = torch.tensor([r["logits"] for r in rows])
    assert (theirs - ours).abs().max().item() <= 1e-5
    base = transformers.ModernBertForMaskedLM.from_pretrained(hf_dir).model.embeddings.tok_embeddings.weight
    assert not torch.equal(hf.model.embeddings.tok_embeddings.weight, base)  # the backbone was trained too


def test_a_wordpiece_vocab_cannot_replace_the_checkpoints_tokenizer(hf_dir, sst2, tmp_path):
    from bertdist.finetune import FinetuneConfig, VocabMismatch
    from bertdist.finetune.train import resolve_tokenizer

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nfilm\n")
    cfg = FinetuneConfig(task="sst2", checkpoint=str(hf_dir), data=str(sst2), vocab_file=str(vocab))
    with pytest.raises(VocabMismatch, match="brings its own tokenizer"):
        resolve_tokenizer(cfg, load_pretrained(hf_dir))


NER_SENTENCES = [
    ("John Smith lives in Paris .", "B-PER I-PER O O B-LOC O"),
    ("Mary visited Berlin with Peter .", "B-PER O B-LOC O B-PER O"),
    ("Acme Corp works in London .", "B-ORG I-ORG O O B-LOC O"),
    ("Peter and Mary love Paris .", "B-PER O B-PER O B-LOC O"),
]


def _conll(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    body = "\n".join("\n".join(f"{w} {t}" for w, t in zip(s.split(), tags.split())) + "\n"
                     for s, tags in NER_SENTENCES * 3)
    (d / "train.txt").write_text(body)
    (d / "valid.txt").write_text(body)
    return d


def test_ner_words_are_tokenized_as_running_text(hf_dir):
    """A byte-level BPE marks a word after a space ("Ġword"): pre-split words get the same tokens
    as the sentence they came from, and each token keeps its word."""
    from bertdist.export.tokenizer import fast_tokenizer
    from bertdist.finetune.tasks import as_running_text

    tok = fast_tokenizer(hf_dir / "tokenizer.json")
    words = "John Smith lives in Paris .".split()
    split = tok(as_running_text(words), is_split_into_words=True)
    assert split["input_ids"] == tok(" ".join(words))["input_ids"]
    assert split["input_ids"] != tok(words, is_split_into_words=True)["input_ids"]  # what it would be without
    assert sorted(set(w for w in split.word_ids() if w is not None)) == list(range(len(words)))


def _finetune(tmp_path, ckpt, task, data, **kw):
    from bertdist.finetune import FinetuneConfig, run_finetune

    cfg = FinetuneConfig(task=task, checkpoint=str(ckpt), data=str(data), output_dir=str(tmp_path / task),
                         max_seq_length=64, batch_size=4, max_steps=4, learning_rate=1e-3, progress=False,
                         save_model=True, predict_test=False, tensorboard=False, **kw)
    return run_finetune(cfg), tmp_path / task / "model"


@pytest.mark.parametrize("task,hf_class", [("ner", "ModernBertForTokenClassification"),
                                           ("squad2", "ModernBertForQuestionAnswering"),
                                           ("swag", "ModernBertForMultipleChoice")])
def test_token_span_and_choice_tasks_run_and_export(hf_dir, tmp_path, task, hf_class):
    from tests.finetune import fixtures

    if task == "ner":
        data, kw = _conll(tmp_path / "conll"), {}
    elif task == "swag":
        data, kw = fixtures.write_swag(tmp_path / "swag", n_train=8, n_dev=4), {}
    else:
        f = fixtures.write_squad_v2(tmp_path / "squad" / "dev-v2.0.json", n_paragraphs=3)
        data, kw = f.parent, dict(train_file=str(f), doc_stride=16, max_query_length=16)
    summary, model_dir = _finetune(tmp_path, hf_dir, task, data, **kw)
    metrics = summary["best"]["metrics"]["dev"]
    assert {"ner": "f1", "squad2": "f1", "swag": "accuracy"}[task] in metrics
    hf, info = getattr(transformers, hf_class).from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    if task == "ner":
        assert set(hf.config.id2label.values()) == {"O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG"}
    if task == "squad2":
        rows = json.loads((tmp_path / task / "predictions" / "dev.json").read_text())
        squad = json.loads(f.read_text())
        contexts = {q["id"]: p["context"] for a in squad["data"] for p in a["paragraphs"] for q in p["qas"]}
        for r in rows:  # every answer is a span of its context, without the space a BPE token carries
            assert r["prediction"] == r["prediction"].strip() and r["prediction"] in contexts[r["id"]]


def test_a_modernbert_pretrained_on_a_wordpiece_vocab(sst2, tmp_path):
    """A bertdist ModernBERT whose records were made with a WordPiece vocab (a torch-format directory
    with vocab.txt, its embedding table padded past the vocab): fine-tuned with that vocab, saved
    with BERT's tokenizer files, and reproduced by transformers."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from bertdist.export.sources import PretrainedWeights
    from bertdist.finetune import FinetuneConfig, run_finetune
    from bertdist.finetune.glue import GLUE_TASKS, read_glue
    from bertdist.model.modernbert import ModernBertForMaskedLM
    from bertdist.model.modernbert_config import ModernBertConfig

    words = sorted({w for s in CORPUS for w in s.lower().replace(".", " .").replace("?", " ?").split()})
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words, ","]) + "\n")
    n = len(vocab.read_text().splitlines())
    cfg = ModernBertConfig.from_preset("tiny", vocab_size=n + (-n) % 64, max_position_embeddings=128,
                                       local_attention=16, pad_token_id=0, cls_token_id=2, sep_token_id=3,
                                       bos_token_id=2, eos_token_id=3)
    torch.manual_seed(0)
    ckpt = write_torch_dir(tmp_path / "torch", PretrainedWeights(cfg, ModernBertForMaskedLM(cfg).state_dict(), vocab,
                                                                 True, {"kind": "test"}))
    w = load_pretrained(ckpt)
    assert w.vocab_file == ckpt / "vocab.txt" and w.tokenizer_json is None and cfg.vocab_size > n
    out = tmp_path / "run"
    run_finetune(FinetuneConfig(task="sst2", checkpoint=str(ckpt), data=str(sst2), output_dir=str(out),
                                max_seq_length=32, batch_size=4, max_steps=4, learning_rate=1e-3, progress=False,
                                save_model=True, predict_test=False, tensorboard=False))
    hf, info = AutoModelForSequenceClassification.from_pretrained(out / "model", output_loading_info=True)
    assert type(hf).__name__ == "ModernBertForSequenceClassification" and not info["missing_keys"]
    tok = AutoTokenizer.from_pretrained(out / "model")
    from bertdist.export.tokenizer import bert_tokenizer

    assert (out / "model" / "vocab.txt").is_file()
    assert tok("The man, truly fine.")["input_ids"] == bert_tokenizer(vocab, True)("The man, truly fine.")["input_ids"]
    ex = read_glue(GLUE_TASKS["sst2"], sst2 / "dev.tsv")
    enc = tok([e.text_a for e in ex], padding=True, return_tensors="pt")
    with torch.no_grad():
        theirs = hf.eval()(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
    ours = torch.tensor([r["logits"] for r in json.loads((out / "predictions" / "dev.json").read_text())])
    assert (theirs - ours).abs().max().item() <= 1e-5
