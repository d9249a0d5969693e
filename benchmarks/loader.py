"""Loader throughput: sequences/s per process at seq 128 and 512 (target: >= 20,000 at seq 128).

Builds unmasked records with the real pipeline from the bundled sample text (or uses
``--manifest-128`` / ``--manifest-512``), then times the trainer's loader producing padded,
dynamically masked (optionally whole-word) micro-batches in the calling thread: reading the
shards' windows, gathering rows, padding, masking, building the tensors. No prefetch thread,
so the number is what one process's loader costs its trainer.

    .venv/bin/python benchmarks/loader.py [--micro 256] [--steps 200] [--whole-word]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# benchmarks/data_pipeline.py would shadow the data_pipeline package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
SAMPLES = REPO / "data_pipeline" / "samples"


def build(seq: int, out: Path, vocab: Path) -> Path:
    from data_pipeline import build_records

    return build_records([f"wiki:{SAMPLES / 'wiki'}", f"books:{SAMPLES / 'books'}"], out, vocab,
                         max_seq_length=seq, dupe_factor=5 if seq == 128 else 10, num_shards=4,
                         heldout_fraction=0.0, masking="dynamic")


def measure(manifest: Path, vocab: Path, seq: int, micro: int, steps: int, whole_word: bool) -> dict:
    from bertdist.data import continuation_mask
    from bertdist.train.config import LoaderConfig
    from bertdist.train.loader import LoaderState, PretrainingLoader, open_training_records

    src = open_training_records(manifest, vocab, seq)
    micro = min(micro, src.num_rows)
    cfg = LoaderConfig(max_seq_length=seq, micro_batch_size=micro, global_batch_size=micro,
                     whole_word_mask=whole_word, prefetch_steps=0, shuffle_window_shards=4)
    loader = PretrainingLoader(src, cfg, rank=0, world_size=1, grad_accum=1, continuation=continuation_mask(vocab))
    it = loader.steps(LoaderState())
    for _ in range(3):  # warm: first window read
        next(it)
    n = tokens = 0
    t = time.perf_counter()
    for _ in range(steps):
        batches, _ = next(it)
        for b in batches:
            n += b["input_ids"].shape[0]
            tokens += int(b["attention_mask"].sum())
    dt = time.perf_counter() - t
    return {"seq": seq, "micro_batch": micro, "whole_word_mask": whole_word, "rows_in_records": src.num_rows,
            "seq_per_s": n / dt, "real_tokens_per_s": tokens / dt, "mean_length": tokens / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--micro", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--whole-word", action="store_true")
    ap.add_argument("--vocab", default=None, help="vocab.txt (default: ../shared/data BERT uncased, else trained)")
    ap.add_argument("--manifest-128")
    ap.add_argument("--manifest-512")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bertdist-loader-bench-"))
    vocab = Path(args.vocab) if args.vocab else REPO.parent / "shared" / "data" / "vocab" / "bert-base-uncased-vocab.txt"
    if not vocab.is_file():
        from data_pipeline.config import InputConfig
        from data_pipeline.tokenization import train_vocab
        from data_pipeline.vocab_corpus import iter_sentences

        vocab = tmp / "vocab.txt"
        train_vocab(iter_sentences([InputConfig(kind="books", path=str(SAMPLES / "books"))]), vocab,
                    vocab_size=8000, lowercase=True)
    results = []
    for seq, given in ((128, args.manifest_128), (512, args.manifest_512)):
        manifest = Path(given) if given else build(seq, tmp / f"records{seq}", vocab)
        r = measure(manifest, vocab, seq, args.micro, args.steps, args.whole_word)
        results.append(r)
        verdict = "" if seq != 128 else ("  (target >= 20,000: met)" if r["seq_per_s"] >= 20000
                                         else "  (target >= 20,000: NOT met)")
        print(f"seq {seq}: {r['seq_per_s']:,.0f} seq/s per process, {r['real_tokens_per_s']:,.0f} real tokens/s "
              f"(micro-batch {r['micro_batch']}, mean length {r['mean_length']:.0f}, "
              f"whole-word {'on' if args.whole_word else 'off'}){verdict}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
