"""Near-duplicate removal benchmark (not a test): quality on planted near-duplicates, MinHash
speed against datasketch, and dedup's share of a build's wall time.

Corpus: the Wikipedia fragment's articles and the 14 books of ../shared/data, the books cut into
documents of about 1,000 words at paragraph breaks. A random fifth of the documents get a planted
copy (``--fraction``, default 0.2): 1-10% of its words replaced at random, and with probability 1/2 each its paragraphs
reordered and its first line (the header) replaced.

``quality``: runs the build's Deduplicate transform (DirectRunner, one process) on the corpus and
scores it against exact 5-gram Jaccard similarities: recall over the planted pairs at or above
the threshold (found = both in one cluster), precision over the removed documents (their kept
document is at or above the threshold).

``speed``: signatures of every document of the corpus by this project's numpy code (one-permutation
MinHash) and by datasketch's MinHash (128 permutations, ``update_batch`` over the 5-gram strings),
and the estimates' error against the exact Jaccard on the planted pairs. datasketch is only needed
here: ``pip install --target DIR datasketch`` and ``--datasketch DIR``.

``share``: ``bertdist data build`` (one process) on 5 copies of the 14 books in BERT format, each
copy with 15% of its words replaced (so no copy is a near-duplicate of another: all five are
built), with the quality filters and dedup on and off, alternating; their share is
(on - off) / on of the medians, of wall time and of the build's CPU time.

    .venv/bin/python benchmarks/dedup.py quality|speed|share [--repeats 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("BERTDIST_SHARED_DATA", REPO.parent / "shared" / "data"))
sys.path.insert(0, str(REPO))


def shared_documents(words_per_doc: int = 1000) -> dict[str, str]:
    import bz2

    from data_pipeline.decoding import decode_document
    from data_pipeline.text import strip_gutenberg
    from data_pipeline.wikitext import article_paragraphs, iter_page_blobs, parse_page

    docs: dict[str, str] = {}
    for path in sorted((SHARED / "wiki").glob("*.xml.bz2")):
        with bz2.open(path) as f:
            for kind, blob in iter_page_blobs(f, 64 << 20):
                page, _ = parse_page(blob)
                if kind == "page" and page is not None and page.ns == 0 and not page.redirect:
                    paras = article_paragraphs(page.title, page.text)
                    if paras:
                        docs[f"wiki:{page.page_id}"] = "\n\n".join(paras)
    for path in sorted((SHARED / "books").glob("*.txt")):
        text = strip_gutenberg(decode_document(path.read_bytes()).text)[0]
        part, n, k = [], 0, 0
        for para in text.split("\n\n"):
            part.append(para)
            n += len(para.split())
            if n >= words_per_doc:
                docs[f"{path.stem}:{k}"] = "\n\n".join(part)
                part, n, k = [], 0, k + 1
        if n >= 50:
            docs[f"{path.stem}:{k}"] = "\n\n".join(part)
    return docs


def plant(docs: dict[str, str], seed: int = 0, fraction: float = 0.2) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """Adds a near copy of a random ``fraction`` of the documents; returns (corpus, planted pairs)."""
    r = random.Random(seed)
    vocab = sorted({w for t in list(docs.values())[:200] for w in t.split()})
    out, pairs = dict(docs), []
    for doc_id in r.sample(sorted(docs), int(len(docs) * fraction)):
        paras = docs[doc_id].split("\n\n")
        if r.random() < 0.5 and len(paras) > 2:
            r.shuffle(paras)
        if r.random() < 0.5:
            paras[0] = "Chapter " + str(r.randint(1, 99)) + ". " + " ".join(r.choice(vocab) for _ in range(6))
        words = "\n\n".join(paras).split(" ")
        for i in r.sample(range(len(words)), int(len(words) * r.uniform(0.01, 0.10))):
            words[i] = r.choice(vocab)
        copy_id = f"{doc_id}#copy"
        out[copy_id] = " ".join(words)
        pairs.append((doc_id, copy_id))
    return out, pairs


def ngram_set(text: str) -> set[int]:
    from data_pipeline import dedup

    return set(dedup.ngram_hashes(dedup.word_hashes(text), 5).tolist())


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def quality(args) -> dict:
    import apache_beam as beam

    from data_pipeline.beam.dedup import Deduplicate
    from data_pipeline.config import DedupConfig

    docs, planted = plant(shared_documents(), seed=args.seed, fraction=args.fraction)
    cfg = DedupConfig(threshold=args.threshold, sample_pairs=10**9)
    report = tempfile.mkdtemp(prefix="dedup-bench-")
    t0 = time.time()
    opts = beam.options.pipeline_options.PipelineOptions(
        ["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"])
    with beam.Pipeline(options=opts) as p:
        _ = p | beam.Create(sorted(docs.items())) | Deduplicate("bench", cfg, report)
    wall = time.time() - t0
    rows = json.loads(Path(report, "dedup", "bench.json").read_text())["pairs"]
    kept_of = {r["removed"]: r["kept"] for r in rows}
    rep = lambda d: kept_of.get(d, d)  # noqa: E731 - the document a cluster keeps
    sets = {}

    def s(d):
        if d not in sets:
            sets[d] = ngram_set(docs[d])
        return sets[d]

    truth = [(a, b, jaccard(s(a), s(b))) for a, b in planted]
    above = [(a, b) for a, b, j in truth if j >= args.threshold]
    found = sum(rep(a) == rep(b) for a, b in above)
    removed = [(r["removed"], r["kept"]) for r in rows if r["kind"] == "near"]
    js = [jaccard(s(a), s(b)) for a, b in removed]
    return {
        "documents": len(docs), "planted_pairs": len(planted), "planted_pairs_at_or_above_threshold": len(above),
        "threshold": args.threshold, "wall_s": round(wall, 2),
        "recall": round(found / len(above), 4) if above else None,
        "near_removed": len(removed), "exact_removed": sum(r["kind"] == "exact" for r in rows),
        "precision": round(sum(j >= args.threshold for j in js) / len(js), 4) if js else None,
        "precision_at_threshold_minus_0.05": round(sum(j >= args.threshold - 0.05 for j in js) / len(js), 4) if js else None,
        "removed_pair_jaccard_min": round(min(js), 4) if js else None,
        "missed_jaccards": sorted(round(j, 3) for a, b, j in truth if j >= args.threshold and rep(a) != rep(b)),
    }


def speed(args) -> dict:
    import numpy as np

    from data_pipeline import dedup

    if args.datasketch:
        sys.path.insert(0, args.datasketch)
    from datasketch import MinHash

    docs, planted = plant(shared_documents(), seed=args.seed)
    ids = sorted(docs)
    words = sum(len(docs[d].split()) for d in ids)

    def ours(text):
        return dedup.minhash(dedup.ngram_hashes(dedup.word_hashes(text), 5), 128)

    def kperm(text):  # 128 independent multiply-shift permutations of the same n-gram hashes
        h = dedup.ngram_hashes(dedup.word_hashes(text), 5)
        a = (np.random.default_rng(9).integers(0, 1 << 63, 128, dtype=np.uint64) << np.uint64(1)) | np.uint64(1)
        out = np.full(128, np.uint64(1 << 32) - np.uint64(1), np.uint64)
        with np.errstate(over="ignore"):
            for lo in range(0, len(h), 4096):
                np.minimum(out, ((h[lo:lo + 4096, None] * a) >> np.uint64(32)).min(axis=0), out=out)
        return out.astype(np.uint32)

    def datasketch(text):
        w = text.lower().split()
        m = MinHash(num_perm=128, seed=1)
        m.update_batch([" ".join(w[i:i + 5]).encode() for i in range(max(1, len(w) - 4))])
        return m.hashvalues

    out = {"documents": len(ids), "words": words}
    sets = {d: ngram_set(docs[d]) for pair in planted for d in pair}
    for name, fn in (("numpy_one_permutation", ours), ("numpy_128_permutations", kperm), ("datasketch_128", datasketch)):
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            sigs = {d: fn(docs[d]) for d in ids}
            times.append(time.perf_counter() - t)
        err = [float(np.mean(sigs[a] == sigs[b])) - jaccard(sets[a], sets[b]) for a, b in planted]
        out[name] = {"seconds": [round(x, 3) for x in times], "median_s": round(statistics.median(times), 3),
                     "words_per_s": round(words / statistics.median(times)),
                     "estimate_error_mean": round(float(np.mean(err)), 4), "estimate_error_std": round(float(np.std(err)), 4)}
    return out


def bert_format_copies(out: Path, copies: int, edit: float, seed: int) -> int:
    from data_pipeline.decoding import decode_document
    from data_pipeline.text import text_to_sentences

    r = random.Random(seed)
    books = [" \n".join(text_to_sentences(decode_document(p.read_bytes()).text))
             for p in sorted((SHARED / "books").glob("*.txt"))]
    vocab = sorted({w for b in books[:3] for w in b.split()})
    words = 0
    with out.open("w") as f:
        for _ in range(copies):
            for book in books:
                lines = []
                for line in book.split(" \n"):
                    ws = line.split()
                    for i in range(len(ws)):
                        if r.random() < edit:
                            ws[i] = r.choice(vocab)
                    words += len(ws)
                    lines.append(" ".join(ws))
                f.write("\n".join(lines) + "\n\n")
    return words


def share(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="dedup-share-"))
    inp = tmp / "books5x.txt"
    words = bert_format_copies(inp, 5, 0.15, args.seed)
    vocab = SHARED / "vocab" / "bert-base-uncased-vocab.txt"
    walls: dict[str, list[float]] = {"on": [], "off": []}
    cpus: dict[str, list[float]] = {"on": [], "off": []}
    manifests = {}
    for i in range(args.repeats):
        for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
            out = tmp / f"out-{mode}"
            sets = ["--set", "quality.enabled=false", "--set", "dedup.enabled=false"] if mode == "off" else []
            cmd = [sys.executable, "-m", "bertdist.cli.main", "data", "build", "--input", f"text:{inp}", "--vocab",
                   str(vocab), "--output", str(out), "--set", "max_seq_length=128", "--set", "dupe_factor=5",
                   *sets, "--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]
            t, c = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run(cmd, check=True, cwd=REPO, capture_output=True)
            walls[mode].append(round(time.time() - t, 2))
            c2 = resource.getrusage(resource.RUSAGE_CHILDREN)  # CPU time: steadier than wall on a busy machine
            cpus[mode].append(round(c2.ru_utime + c2.ru_stime - c.ru_utime - c.ru_stime, 2))
            manifests[mode] = json.loads((out / "manifest.json").read_text())
    on, off = statistics.median(walls["on"]), statistics.median(walls["off"])
    con, coff = statistics.median(cpus["on"]), statistics.median(cpus["off"])
    return {"input_words": words, "walls_s": walls, "median_on_s": on, "median_off_s": off,
            "dedup_and_filters_share": round((on - off) / on, 4), "cpu_s": cpus, "median_cpu_on_s": con,
            "median_cpu_off_s": coff, "dedup_and_filters_cpu_share": round((con - coff) / con, 4),
            "documents": {m: manifests[m]["counts"]["documents"] for m in manifests},
            "dedup": manifests["on"]["dedup"]["sources"], "quality_dropped": {
                k: v["documents_dropped"] for k, v in manifests["on"]["quality"].items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("quality", "speed", "share"))
    ap.add_argument("--threshold", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fraction", type=float, default=0.2, help="quality: the share of documents given a planted copy")
    ap.add_argument("--datasketch", help="a folder holding datasketch (pip install --target)")
    ap.add_argument("--json")
    args = ap.parse_args()
    res = {"quality": quality, "speed": speed, "share": share}[args.what](args)
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
