"""Small real-text retrieval sets and tiny encoders for the embedding tests (no ../shared needed).

``book_pairs``: from a bundled book (data_pipeline/samples/books), paragraphs of 3+ sentences; the
query is one of the paragraph's sentences, the positive the paragraph without it (the inverse
cloze task): real text whose relevant passage is known without labelling."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BOOKS = REPO / "data_pipeline" / "samples" / "books"
_SENT = re.compile(r"(?<=[.!?])[\"']?\s+(?=[\"']?[A-Z])")


def paragraphs(book: str) -> list[str]:
    text = (BOOKS / book).read_text(encoding="utf-8")
    out = []
    for block in re.split(r"\n\s*\n", text):
        p = " ".join(block.split())
        if 40 <= len(p.split()) <= 140:
            out.append(p)
    return out


def book_pairs(book: str = "austen-persuasion.txt", start: int = 0, n: int = 48, seed: int = 0) -> list[dict]:
    """``n`` rows {"query", "positive"} from the paragraphs of ``book`` from the ``start``-th usable one."""
    rng = random.Random(seed)
    rows = []
    for p in paragraphs(book)[start:]:
        sents = [s.strip() for s in _SENT.split(p) if s.strip()]
        if len(sents) < 3:
            continue
        i = rng.randrange(len(sents))
        if len(sents[i].split()) < 6:
            continue
        rows.append({"query": sents[i], "positive": " ".join(sents[:i] + sents[i + 1:])})
        if len(rows) == n:
            break
    assert len(rows) == n, f"{book} has only {len(rows)} usable paragraphs after {start}"
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def retrieval_dir(d: Path, n_train: int = 48, n_dev: int = 24, negatives: int = 0) -> Path:
    """train.jsonl from Persuasion's first paragraphs, dev.jsonl from later ones; with
    ``negatives``, each dev row lists that many other dev rows' positives."""
    rows = book_pairs("austen-persuasion.txt", 0, n_train + n_dev)
    train, dev = rows[:n_train], rows[n_train:]
    if negatives:
        dev = [{**r, "negatives": [dev[(i + j + 1) % len(dev)]["positive"] for j in range(negatives)]}
               for i, r in enumerate(dev)]
    write_jsonl(d / "train.jsonl", train)
    write_jsonl(d / "dev.jsonl", dev)
    return d


def word_vocab(path: Path, size: int = 3000) -> Path:
    """A deterministic uncased WordPiece vocab: the special tokens, every character of the books
    and its ``##`` continuation, then their most frequent words (ties alphabetical). A trained
    WordPiece vocab orders tied merges differently from run to run; the tests' numbers should not."""
    import collections
    import unicodedata

    counts: collections.Counter = collections.Counter()
    chars: set[str] = set()
    for book in sorted(BOOKS.glob("*.txt")):
        text = unicodedata.normalize("NFD", book.read_text(encoding="utf-8").lower())
        text = "".join(c for c in text if unicodedata.category(c) != "Mn")  # BERT's uncased accent stripping
        for word in re.findall(r"\w+|[^\w\s]", text):
            counts[word] += 1
            chars.update(word)
    singles = sorted(chars)
    words = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if len(w) > 1]
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + singles + [f"##{c}" for c in singles]
    tokens += words[:max(0, size - len(tokens))]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    return path


def tiny_checkpoint(out: Path, vocab: Path, seed: int = 0, **config) -> Path:
    """A randomly initialised tiny BERT (2 layers, hidden 128 unless overridden) as an HF directory."""
    import torch

    from bertdist.export import write_hf_dir
    from bertdist.model import BertConfig, BertForPreTraining

    n = len(vocab.read_text(encoding="utf-8").splitlines())
    torch.manual_seed(seed)
    config.setdefault("max_position_embeddings", 256)
    cfg = BertConfig.from_preset("tiny", kernels="reference", vocab_size=n, **config)
    write_hf_dir(out, cfg, BertForPreTraining(cfg, device_type="cpu").state_dict(), vocab)
    return out
