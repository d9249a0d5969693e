"""`make demo`: the main job on bundled real text (data_pipeline/samples), stage by stage.

Each stage prints what it did and how long it took; the summary at the end lists the
artifacts. The chain grows as capabilities land: today it trains a small WordPiece vocab on
the bundled books, runs the tiny model forward and backward on real sentences for a few
optimizer steps (the MLM loss must fall), and prints the model summary for base and large.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

SAMPLES = Path(__file__).resolve().parents[1] / "data_pipeline" / "samples"


class Stages:
    """Times each stage and collects a one-line result for the summary."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, str]] = []

    def run(self, name: str, fn, *args):
        print(f"\n=== {name}", flush=True)
        t0 = time.perf_counter()
        result, line = fn(*args)
        dt = time.perf_counter() - t0
        self.rows.append((name, dt, line))
        print(f"--- {name}: {line} ({dt:.1f} s)", flush=True)
        return result

    def summary(self) -> None:
        print("\n=== summary")
        for name, dt, line in self.rows:
            print(f"  {name:<28} {dt:7.1f} s  {line}")


def train_vocab(out: Path):
    from tokenizers import BertWordPieceTokenizer

    books = sorted(str(p) for p in (SAMPLES / "books").glob("*.txt"))
    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train(books, vocab_size=8000, min_frequency=2, show_progress=False,
              special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    out.mkdir(parents=True, exist_ok=True)
    tok.save_model(str(out))
    return out / "vocab.txt", f"WordPiece vocab of {tok.get_vocab_size()} tokens from {len(books)} books -> {out / 'vocab.txt'}"


def sentences_from_books(limit: int) -> list[str]:
    text = " ".join(p.read_text(encoding="utf-8") for p in sorted((SAMPLES / "books").glob("*.txt")))
    words = text.split()
    # Fixed-size word windows: real text, no sentence splitter needed for this smoke stage.
    return [" ".join(words[i:i + 40]) for i in range(0, min(len(words), limit * 40), 40)]


def tiny_forward_backward(vocab_path: Path):
    from transformers import BertTokenizerFast

    from bertdist.model import BertConfig, BertForPreTraining

    tok = BertTokenizerFast(vocab_file=str(vocab_path), do_lower_case=True)
    texts = sentences_from_books(256)
    enc = tok(texts, padding=True, truncation=True, max_length=64, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    torch.manual_seed(0)
    rng = random.Random(0)
    cfg = BertConfig.from_preset("tiny", vocab_size=tok.vocab_size)
    model = BertForPreTraining(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    special = torch.tensor(tok.all_special_ids)
    losses = []
    for step in range(30):
        rows = torch.tensor(rng.sample(range(len(texts)), 32))
        x, m = ids[rows].clone(), mask[rows]
        pick = (torch.rand(x.shape) < 0.15) & m.bool() & ~torch.isin(x, special)
        labels = torch.where(pick, x, torch.full_like(x, -100))
        x[pick] = tok.mask_token_id
        out = model(x, m, torch.zeros_like(x), labels=labels)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
        if step % 10 == 0 or step == 29:
            print(f"  step {step:2d}  mlm loss {out.loss.item():.3f}  ({int(pick.sum())} masked tokens)")
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    if not last < first:
        raise SystemExit(f"demo: MLM loss did not fall ({first:.3f} -> {last:.3f})")
    return losses, (f"tiny model ({sum(p.numel() for p in model.parameters()):,} params, kernels "
                    f"{model.bert.kernels.sources['attention']}), 30 steps on real text, "
                    f"mean loss {first:.2f} -> {last:.2f}")


def model_summaries():
    for preset in ("base", "large"):
        subprocess.run([sys.executable, "-m", "bertdist.cli.main", "model", "summary", "--preset", preset], check=True)
    return None, "printed for base and large"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="demo_out", help="where artifacts go")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stages = Stages()
    vocab = stages.run("vocab", train_vocab, out / "vocab")
    losses = stages.run("tiny forward+backward", tiny_forward_backward, vocab)
    stages.run("model summary", model_summaries)
    (out / "demo_metrics.json").write_text(json.dumps({"mlm_losses": losses}, indent=1))
    stages.summary()
    print(f"  artifacts: {out.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
