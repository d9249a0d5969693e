"""WordPiece document encoder micro-benchmark: the Python path vs the native encoder (not a test).

Workload: the 14 Gutenberg books of ../shared/data/books, split into sentences as
benchmarks/data_pipeline.py's make_bert_format does, one document per book (cut at 20,000
sentences as the pipeline's Tokenize does), uncased BERT vocab by default. Times
WordPieceEncoder.encode_document over all documents on one core: cold (a new encoder, empty
cache) and warm (the same encoder again), best of --repeats, plus normalize() alone (Python in
both paths). Checks that both paths gave the same ids and bounds.

    .venv/bin/python benchmarks/wordpiece_native.py [--repeats 3] [--vocab cased] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("BERTDIST_SHARED_DATA", REPO.parent / "shared" / "data"))


def book_documents(max_sentences: int = 20_000) -> tuple[list[list[str]], int]:
    from data_pipeline.text import text_to_sentences

    docs, words = [], 0
    for path in sorted((SHARED / "books").glob("*.txt")):
        sents = text_to_sentences(path.read_text(encoding="utf-8", errors="replace"))
        words += len("\n".join(sents).split())
        docs += [sents[j:j + max_sentences] for j in range(0, len(sents), max_sentences)]
    return docs, words


def time_pass(encoder, docs) -> tuple[float, list]:
    t0 = time.perf_counter()
    out = [encoder.encode_document(d) for d in docs]
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab", choices=["uncased", "cased"], default="uncased")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from data_pipeline.tokenization import load_tokenizer
    from data_pipeline.wordpiece import WordPieceEncoder, native_available, native_unavailable_reason

    if not native_available():
        sys.exit(f"native encoder unavailable: {native_unavailable_reason()}")
    tok, lowercase = load_tokenizer(SHARED / "vocab" / f"bert-base-{args.vocab}-vocab.txt")
    docs, words = book_documents()
    mb = sum(len(s.encode()) for d in docs for s in d) / 1e6
    results: dict = {"documents": len(docs), "words": words, "MB": round(mb, 2), "vocab": args.vocab,
                     "loadavg_before": os.getloadavg()}
    probe = WordPieceEncoder(tok, lowercase, native=False)
    texts = ["\n".join(d) for d in docs]
    t0 = time.perf_counter()
    for t in texts:
        probe.normalize(t)
    results["normalize_s"] = round(time.perf_counter() - t0, 3)
    outputs = {}
    for name, native in (("python", False), ("native", True)):
        cold, warm = [], []
        for _ in range(args.repeats):
            enc = WordPieceEncoder(tok, lowercase, native=native)
            c, outputs[name] = time_pass(enc, docs)
            w, _ = time_pass(enc, docs)
            cold.append(c)
            warm.append(w)
        results[name] = {"cold_s": round(min(cold), 3), "warm_s": round(min(warm), 3),
                         "cold_words_per_s": round(words / min(cold)), "warm_words_per_s": round(words / min(warm)),
                         "cold_all_s": [round(x, 3) for x in cold], "warm_all_s": [round(x, 3) for x in warm]}
    same = all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
               for a, b in zip(outputs["python"], outputs["native"]))
    results["identical"] = same
    results["speedup_cold"] = round(results["python"]["cold_s"] / results["native"]["cold_s"], 2)
    results["speedup_warm"] = round(results["python"]["warm_s"] / results["native"]["warm_s"], 2)
    results["loadavg_after"] = os.getloadavg()
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    if not same:
        sys.exit("native and Python encoders DIFFER")


if __name__ == "__main__":
    main()
