"""Instance creation micro-benchmark: the Python reference vs the native builder (not a test).

Workload: the 14 Gutenberg books of ../shared/data/books, tokenized once with the uncased BERT
vocab (one document per book, split at 20,000 sentences as the pipeline's Tokenize does), then
training instances for every document with the pipeline's defaults: dupe_factor 5,
max_seq_length 128, NSP (negatives dealt from one bucket of all the documents), static masking (0.15, max 20).
Times only instance creation (what _CreateInstancesDoFn.process does per document), one core,
and checks that both builders gave the same batches.

    .venv/bin/python benchmarks/instances_native.py [--repeats 3] [--json out.json]
    .venv/bin/python benchmarks/instances_native.py --doc-sentences 60   # Wikipedia-sized documents
    .venv/bin/python benchmarks/instances_native.py --whole-word          # whole-word masking
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("BERTDIST_SHARED_DATA", REPO.parent / "shared" / "data"))
FIELDS = ("keys", "ids", "ids_offsets", "num_a", "nsp", "mpos", "mids", "m_offsets")


def tokenized_books(vocab: Path, max_sentences: int = 20_000):
    from data_pipeline.text import text_to_sentences
    from data_pipeline.tokenization import load_tokenizer
    from data_pipeline.wordpiece import WordPieceEncoder

    tok, lowercase = load_tokenizer(vocab)
    encoder = WordPieceEncoder(tok, lowercase)
    docs, words = [], 0
    for path in sorted((SHARED / "books").glob("*.txt")):
        sents = text_to_sentences(path.read_text(encoding="utf-8", errors="replace"))
        words += sum(s.count(" ") + 1 for s in sents)
        for j in range(0, len(sents), max_sentences):
            ids, bounds = encoder.encode_document(sents[j:j + max_sentences])
            docs.append((f"books:{path.name}#part{j // max_sentences}", ids, bounds))
    return docs, words


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--doc-sentences", type=int, default=20_000,
                    help="cut the books into documents of this many sentences (20,000: the pipeline's default cut; "
                         "~60 makes Wikipedia-sized documents, where the per-document Python overhead shows)")
    ap.add_argument("--whole-word", action="store_true", help="static whole-word masking (the vocab's '##' table)")
    args = ap.parse_args()

    from bertdist.data.vocab import continuation_mask, load_vocab
    from data_pipeline import instance_native
    from data_pipeline.config import BuildConfig
    from data_pipeline.instance_algorithm import InstanceStats, create_instances
    from data_pipeline.instance_batch import InstanceBatch
    from data_pipeline.negatives import NegativeSource, canonical_order, placement_hash
    from data_pipeline.pipeline import instance_params

    if not instance_native.available():
        sys.exit(f"native builder unavailable: {instance_native.unavailable_reason()}")
    vocab = SHARED / "vocab" / "bert-base-uncased-vocab.txt"
    cfg = BuildConfig(max_seq_length=128, dupe_factor=5, objective="nsp", masking="static", whole_word_mask=args.whole_word)
    params = instance_params(cfg, load_vocab(vocab))
    continuation = continuation_mask(vocab) if args.whole_word else None
    t0 = time.perf_counter()
    docs, words = tokenized_books(vocab, args.doc_sentences)
    tokens = sum(d[1].shape[0] for d in docs)
    print(f"tokenized {len(docs)} documents, {words:,} words, {tokens:,} tokens in {time.perf_counter() - t0:.1f} s")
    order = canonical_order([placement_hash(d[0]) for d in docs], [d[0] for d in docs], [d[1] for d in docs])
    docs = [docs[i] for i in order]  # one bucket, in the pipeline's order: document i is at place i
    source = NegativeSource.from_documents(docs, seed=cfg.seed)

    def reference():
        stats = InstanceStats()
        out = []
        for place, d in enumerate(docs):
            deal = source.dealer(place)
            out.append(InstanceBatch.concat([create_instances(*d, k, params=params, seed=cfg.seed, negatives=deal,
                                                              continuation=continuation, stats=stats)
                                             for k in range(cfg.dupe_factor)]))
            stats.count_windows(deal)
        return out, stats

    def native():
        stats = InstanceStats()
        out = [instance_native.create_document_instances(*d, cfg.dupe_factor, params=params, seed=cfg.seed,
                                                         negatives=source, doc_index=place, continuation=continuation,
                                                         stats=stats) for place, d in enumerate(docs)]
        return out, stats

    results = {}
    outputs = {}
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name, fn in (("reference", reference), ("native", native)):
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            batches, stats = fn()
            times.append(time.perf_counter() - t)
        outputs[name] = (batches, stats)
        n = stats.instances
        best, med = min(times), statistics.median(times)
        results[name] = dict(seconds=times, best_s=best, median_s=med, instances=n, instances_per_s=n / med,
                             words_per_s=words / med)
        print(f"{name:9s}: {n:,} instances, runs {' '.join(f'{x:.3f}' for x in times)} s, median {med:.3f} s: "
              f"{n / med:,.0f} instances/s, {words / med:,.0f} input words/s")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    (ref_b, ref_s), (nat_b, nat_s) = outputs["reference"], outputs["native"]
    same = ref_s == nat_s and all(np.array_equal(getattr(a, f), getattr(b, f)) and getattr(a, f).dtype == getattr(b, f).dtype
                                  for a, b in zip(ref_b, nat_b) for f in FIELDS)
    ratio = results["reference"]["median_s"] / results["native"]["median_s"]
    print(f"native / reference speed: {ratio:.2f}x (median times); outputs bitwise identical: {same}")
    if args.json:
        args.json.write_text(json.dumps(dict(results=results, ratio=ratio, identical=same, documents=len(docs),
                                             words=words, tokens=tokens, loadavg_after=os.getloadavg()), indent=2))
    if not same:
        sys.exit("the builders disagree")


if __name__ == "__main__":
    main()
