"""An ELECTRA discriminator as the backbone of fine-tuning and distillation
(bertdist/finetune/heads.py ``ElectraForTask``; bertdist/distill/student.py, teacher.py).

- `finetune` end to end on SST-2-format rows from an exported tiny ELECTRA (discriminator +
  generator/): the saved task model is an ElectraForSequenceClassification that transformers
  loads with every key and whose dev logits equal ours;
- every head kind maps onto its transformers class (token, span, multiple choice, regression);
- the backbone is the discriminator's encoder, weight for weight;
- distillation: an ELECTRA task model as teacher, the exported discriminator (or K of the
  teacher's layers) as student, with the teacher's head where it fits.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bertdist.export import write_hf_dir
from bertdist.export.hf import hf_config_dict
from bertdist.finetune.heads import ElectraForTask, hf_architecture, task_model
from bertdist.model import ElectraConfig
from bertdist.model.electra import ElectraForPreTraining

WORDS = ("a an the film movie story was is very quite truly great good fine lovely awful bad dull boring poor "
         "fun it this and but not").split()
POSITIVE = ["a great film", "the movie was lovely", "this story is truly good", "a fine and fun film",
            "it is a very good movie", "the film was great fun", "quite a lovely story", "truly fine"]
NEGATIVE = ["a dull film", "the movie was awful", "this story is truly bad", "a boring and poor film",
            "it is a very bad movie", "the film was not good", "quite a dull story", "truly awful"]


@pytest.fixture(scope="module")
def vocab(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    p.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *(f"x{i}" for i in range(40))]) + "\n")
    return p


def _config(vocab: Path, **kw) -> ElectraConfig:
    n = len(vocab.read_text().split())
    base = dict(vocab_size=n, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=64, kernels="reference", embedding_size=16, generator_hidden_size=8,
                generator_num_hidden_layers=2, generator_num_attention_heads=1, generator_intermediate_size=32)
    return ElectraConfig(preset="custom", **{**base, **kw})


@pytest.fixture(scope="module")
def exported(tmp_path_factory, vocab) -> Path:
    """A randomly initialised tiny ELECTRA, exported as `bertdist export` writes it."""
    torch.manual_seed(0)
    cfg = _config(vocab)
    out = tmp_path_factory.mktemp("electra")
    return write_hf_dir(out, cfg, ElectraForPreTraining(cfg, device_type="cpu").state_dict(), vocab)


@pytest.fixture(scope="module")
def sst2(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("SST-2")
    rows = [(s, 1) for s in POSITIVE] + [(s, 0) for s in NEGATIVE]
    body = "".join(f"{s}\t{label}\n" for s, label in rows)
    (d / "train.tsv").write_text("sentence\tlabel\n" + body)
    (d / "dev.tsv").write_text("sentence\tlabel\n" + "".join(f"{s}\t{label}\n" for s, label in rows[::3]))
    return d


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory, exported, sst2) -> tuple[Path, dict]:
    from bertdist.finetune import FinetuneConfig, run_finetune

    out = tmp_path_factory.mktemp("sst2")
    cfg = FinetuneConfig(task="sst2", checkpoint=str(exported), data=str(sst2), output_dir=str(out),
                         max_seq_length=16, batch_size=4, max_steps=6, learning_rate=1e-3, progress=False,
                         kernels="reference", save_model=True, predict_test=False, tensorboard=False)
    return out, run_finetune(cfg)


def test_finetune_writes_an_electra_task_model_transformers_reproduces(finetuned, sst2):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out, summary = finetuned
    assert summary["runs"][0]["steps"] == 6
    assert summary["checkpoint_origin"]["kind"] == "hf"
    hf, info = AutoModelForSequenceClassification.from_pretrained(str(out / "model"), output_loading_info=True)
    assert not any(info.values()), info
    assert type(hf).__name__ == "ElectraForSequenceClassification"
    assert hf.config.id2label == {0: "0", 1: "1"} and hf.config.embedding_size == 16
    rows = json.loads((out / "predictions" / "dev.json").read_text())
    sentences = [line.split("\t")[0] for line in (sst2 / "dev.tsv").read_text().splitlines()[1:]]
    tok = AutoTokenizer.from_pretrained(str(out / "model"))
    enc = tok(sentences, truncation=True, max_length=16, padding=True, return_tensors="pt")
    with torch.no_grad():
        theirs = hf.eval()(**enc).logits
    ours = torch.tensor([r["logits"] for r in rows])
    assert ours.shape == theirs.shape == (len(sentences), 2)
    assert (theirs - ours).abs().max() <= 1e-4


def test_the_backbone_is_the_discriminator(exported, vocab):
    from bertdist.export.sources import load_pretrained

    w = load_pretrained(exported)
    model = task_model(w.config, "classification", 2, device_type="cpu")
    assert isinstance(model, ElectraForTask)
    model.load_backbone(w.state_dict)
    own = model.electra.state_dict()
    assert own.keys() == {k[len("discriminator.electra."):] for k in w.state_dict
                          if k.startswith("discriminator.electra.")}
    assert all(torch.equal(v, w.state_dict[f"discriminator.electra.{k}"]) for k, v in own.items())
    assert not any("generator" in k for k in model.state_dict())
    with pytest.raises(KeyError, match="lacks ELECTRA discriminator weights"):
        model.load_backbone({k: v for k, v in w.state_dict.items() if "encoder.layer.1." not in k})


@pytest.mark.parametrize("kind, auto", [("token", "AutoModelForTokenClassification"),
                                        ("span", "AutoModelForQuestionAnswering"),
                                        ("choice", "AutoModelForMultipleChoice"),
                                        ("regression", "AutoModelForSequenceClassification")])
def test_every_head_maps_onto_its_transformers_class(kind, auto, tmp_path, vocab):
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(3)
    cfg = _config(vocab).without_generator()
    model = task_model(cfg, kind, 3 if kind == "token" else 2, device_type="cpu").eval()
    conf = hf_config_dict(cfg, [hf_architecture(kind, cfg)])
    conf.update(num_labels={"token": 3, "regression": 1}.get(kind, 2))
    tmp_path.joinpath("config.json").write_text(json.dumps(conf))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    hf, info = getattr(transformers, auto).from_pretrained(str(tmp_path), output_loading_info=True)
    assert not any(info.values()), info
    assert type(hf).__name__ == hf_architecture(kind, cfg)
    g = torch.Generator().manual_seed(0)
    shape = (2, 3, 10) if kind == "choice" else (3, 10)
    batch = {"input_ids": torch.randint(5, cfg.vocab_size, shape, generator=g),
             "attention_mask": torch.ones(shape, dtype=torch.long), "token_type_ids": torch.zeros(shape, dtype=torch.long)}
    batch["attention_mask"][..., 7:] = 0
    with torch.no_grad():
        ours, _ = model(batch)
        out = hf.eval()(**batch)
    theirs = torch.stack([out.start_logits, out.end_logits], -1) if kind == "span" else out.logits
    theirs = theirs.squeeze(-1) if kind == "regression" else theirs
    real = batch["attention_mask"].bool() if kind in ("token", "span") else torch.ones(ours.shape[:1], dtype=torch.bool)
    assert (ours[real] - theirs[real]).abs().max() <= 1e-4


def test_distillation_takes_electra_teachers_and_students(finetuned, exported):
    from bertdist.distill.student import plan_student
    from bertdist.distill.teacher import load_teacher

    out, _ = finetuned
    teacher = load_teacher(out / "model", "sst2", "classification", 2, device=torch.device("cpu"), kernels="reference")
    assert isinstance(teacher.model, ElectraForTask) and set(teacher.head_state) == {
        "classifier.dense.weight", "classifier.dense.bias", "classifier.out_proj.weight", "classifier.out_proj.bias"}
    plan = plan_student(str(exported), teacher, "classification")  # the pretrained discriminator as student
    student = plan.build("classification", 2, "cpu", kernels="reference")
    assert isinstance(student, ElectraForTask) and plan.head_state  # same family and width: the head is copied
    assert torch.equal(student.classifier.out_proj.weight, teacher.head_state["classifier.out_proj.weight"])
    from bertdist.export.sources import load_pretrained

    w = load_pretrained(exported)
    assert torch.equal(student.electra.encoder.layer[1].output.dense.weight,
                       w.state_dict["discriminator.electra.encoder.layer.1.output.dense.weight"])
    plan = plan_student("layers:1", teacher, "classification")  # K of the teacher's layers: the last one here
    small = plan.build("classification", 2, "cpu", kernels="reference")
    assert len(small.electra.encoder.layer) == 1 and plan.teacher_layers == [1]
    assert torch.equal(small.electra.encoder.layer[0].output.dense.weight,
                       teacher.model.electra.encoder.layer[1].output.dense.weight)
    assert torch.equal(small.electra.embeddings_project.weight, teacher.model.electra.embeddings_project.weight)
    bert = plan_student("preset:tiny", teacher, "classification")
    assert not bert.head_state  # a BERT student of an ELECTRA teacher starts with its own head
    from bertdist.distill.capture import LayerCapture

    cap = LayerCapture(small.backbone, attention=True)  # TinyBERT's intermediate losses read the backbone
    with torch.no_grad():
        small.eval()({"input_ids": torch.tensor([[2, 7, 8, 3]]), "attention_mask": torch.ones(1, 4, dtype=torch.long),
                      "token_type_ids": torch.zeros(1, 4, dtype=torch.long)})
    assert len(cap.hidden) == 1 and cap.probs(torch.ones(1, 4))[0].shape == (1, 2, 4, 4)
