"""Data pipeline throughput and memory benchmark (not a test).

Workload (the reference figure in ../shared/data/README.md): the 14 Gutenberg books split into
sentences (blingfire) in BERT format, max_seq_length 128, dupe_factor 5, masked_lm_prob 0.15,
max_predictions_per_seq 20, uncased BERT vocab. Runs ``bertdist data build`` on the DirectRunner
(multi_processing) and reports input words/s per core, wall time, and peak RSS per process
(driver/runner and each SDK worker), for the corpus at 1x and 5x.

    .venv/bin/python benchmarks/data_pipeline.py [--workers N] [--scales 1,5] [--json out.json]
    .venv/bin/python benchmarks/data_pipeline.py --mode in_memory   # one process, one core

NSP negative diversity against the reference, on the same input (``--negatives``): the shared
corpus (the Wikipedia fragment's articles and the 14 books, parsed and split into sentences by
this pipeline) written once in BERT format; ``bertdist data build`` on it (no held-out split,
seq 128, the given dupe factors) and NVIDIA's PyTorch port of google-research's
create_pretraining_data.py (DeepLearningExamples, PyTorch/LanguageModeling/BERT; a copy outside
this project, with its tokenization.py beside it) on the same file, same settings. For each:
random-next rows, distinct (document, start sentence) windows of their B segments, the largest
reuse and the same-document fallbacks. The reference is instrumented from outside, unchanged: its
``create_instances_from_document`` is wrapped so that ``all_documents`` records the first
sentence read from every random document (``random_document[random_start]``).

    .venv/bin/python benchmarks/data_pipeline.py --negatives --reference /tmp/reference/create_pretraining_data.py \
        [--dupes 1,5] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("BERTDIST_SHARED_DATA", REPO.parent / "shared" / "data"))
REFERENCE_WORDS_PER_S = 59_000


def make_bert_format(out: Path, scale: int) -> int:
    """Books -> one sentence per line, blank line between documents; ``scale`` copies. Returns words."""
    sys.path.insert(0, str(REPO))
    from data_pipeline.text import text_to_sentences

    docs = []
    for p in sorted((SHARED / "books").glob("*.txt")):
        docs.append("\n".join(text_to_sentences(p.read_text(encoding="utf-8", errors="replace"))))
    body = "\n\n".join(docs) + "\n"
    with out.open("w") as f:
        for i in range(scale):
            f.write(body + "\n")
    return len(body.split()) * scale


def run_once(inp: Path, outdir: Path, workers: int, mode: str) -> dict:
    cmd = [sys.executable, "-m", "bertdist.cli.main", "data", "build", "--input", f"text:{inp}",
           "--vocab", str(SHARED / "vocab" / "bert-base-uncased-vocab.txt"), "--output", str(outdir),
           "--set", "max_seq_length=128", "--set", "dupe_factor=5", "--set", "masked_lm_prob=0.15",
           "--set", "max_predictions_per_seq=20", "--set", "num_shards=8",
           "--runner=DirectRunner", f"--direct_running_mode={mode}", f"--direct_num_workers={workers}"]
    log = outdir.parent / f"{outdir.name}.log"
    peak: dict[int, tuple[str, int]] = {}
    done = threading.Event()

    def sample(root: psutil.Process) -> None:  # peak RSS per process, every 100 ms
        while not done.is_set():
            try:
                procs = [root] + root.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for p in procs:
                try:
                    rss = p.memory_info().rss
                    kind = "worker" if "sdk_worker_main" in " ".join(p.cmdline()) else "driver"
                    if rss > peak.get(p.pid, ("", 0))[1]:
                        peak[p.pid] = (kind, rss)
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            done.wait(0.1)

    with log.open("w") as out:
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        sampler = threading.Thread(target=sample, args=(psutil.Process(proc.pid),), daemon=True)
        sampler.start()
        # wait4: the exact end (a polling loop would add up to its period to the wall time) and
        # the CPU time of the build and of every process it started and reaped
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.time() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        done.set()
        sampler.join()
    cpu = usage.ru_utime + usage.ru_stime
    if proc.returncode != 0:
        raise SystemExit(f"build failed ({proc.returncode}):\n{log.read_text()}")
    man = json.loads((outdir / "manifest.json").read_text())
    workers_rss = sorted((r for k, r in peak.values() if k == "worker"), reverse=True)
    driver_rss = max((r for k, r in peak.values() if k == "driver"), default=0)
    return {"wall_s": round(wall, 2), "pipeline_wall_s": man["wall_seconds"], "cpu_s": round(cpu, 1),
            "instances": man["counts"]["instances"], "input_words_counted": man["counts"]["input_words"],
            "peak_rss_worker_mb": [round(r / 2**20) for r in workers_rss],
            "peak_rss_driver_mb": round(driver_rss / 2**20)}


def make_shared_corpus(out: Path) -> dict:
    """The Wikipedia fragment's articles and the 14 books as one BERT-format file, parsed and cut
    into sentences by this pipeline's own functions (what `data build` reads from them)."""
    sys.path.insert(0, str(REPO))
    from data_pipeline import sources
    from data_pipeline import text as textlib
    from data_pipeline.wikitext import article_paragraphs, iter_page_blobs, parse_page

    docs = []
    for dump in sorted((SHARED / "wiki").glob("*.xml*")):
        with sources.open_input(str(dump)) as f:
            for kind, blob in iter_page_blobs(f, 64 << 20):
                page = parse_page(blob)[0] if kind == "page" else None
                if page is None or page.ns != 0 or page.redirect:
                    continue
                paras = article_paragraphs(page.title, page.text)
                if paras is not None:
                    docs.append(textlib.text_to_sentences("\n\n".join(paras)))
    for book in sorted((SHARED / "books").glob("*.txt")):
        text, _ = textlib.strip_gutenberg(book.read_text(encoding="utf-8", errors="replace"))
        docs.append(textlib.text_to_sentences(text))
    docs = [d for d in docs if len(d) >= 2]
    with out.open("w", encoding="utf-8") as f:
        for d in docs:
            f.write("\n".join(s.replace("\n", " ") for s in d) + "\n\n")
    return {"documents": len(docs), "sentences": sum(map(len, docs)), "words": sum(len(s.split()) for d in docs for s in d)}


def window_stats(windows: list, fallbacks: int) -> dict:
    """Random-next rows' (document, start sentence) windows -> the manifest's figures."""
    from collections import Counter

    uses = Counter(windows)
    rows = len(windows) + fallbacks
    return {"random_next": rows, "distinct_windows": len(uses),
            "distinct_fraction": round(len(uses) / rows, 4) if rows else None,
            "max_window_reuse": max(uses.values(), default=0), "same_document_fallbacks": fallbacks}


def run_reference_negatives(reference: Path, inp: Path, dupe_factor: int, seed: int = 12345) -> dict:
    """NVIDIA's create_pretraining_data.py (unchanged) on ``inp``, with its random documents recorded."""
    import importlib.util
    import random
    import types

    sys.path.insert(0, str(reference.parent))  # its tokenization.py
    for name, attrs in (("h5py", {}), ("file_utils", {"cached_path": lambda path, cache_dir=None: path})):
        if name not in sys.modules:  # imported at its top, unused here: HDF5 output, downloads
            sys.modules[name] = types.SimpleNamespace(**attrs)
    spec = importlib.util.spec_from_file_location("reference_cpd", reference)
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    windows: list = []
    fallbacks = [0]

    class Window:  # a random document: records the first sentence read from it (random_start)
        def __init__(self, doc, index, own):
            self.doc, self.index, self.own, self.done = doc, index, own, False

        def __len__(self):
            return len(self.doc)

        def __getitem__(self, j):
            if not self.done:
                self.done = True
                if self.own:
                    fallbacks[0] += 1
                else:
                    windows.append((self.index, j))
            return self.doc[j]

    class Recording(list):  # all_documents: the first access of a call is the document itself
        own_next, current = False, -1

        def __getitem__(self, i):
            doc = list.__getitem__(self, i)
            if self.own_next:
                self.own_next = False
                return doc
            return Window(doc, i, i == self.current)

    original = ref.create_instances_from_document
    recordings: dict[int, Recording] = {}

    def wrapped(all_documents, document_index, *args):
        rec = recordings.get(id(all_documents))
        if rec is None:
            rec = recordings[id(all_documents)] = Recording(all_documents)
        rec.own_next, rec.current = True, document_index
        return original(rec, document_index, *args)

    ref.create_instances_from_document = wrapped
    tokenizer = ref.BertTokenizer(str(SHARED / "vocab" / "bert-base-uncased-vocab.txt"), do_lower_case=True)
    t0 = time.time()
    instances = ref.create_training_instances([str(inp)], tokenizer, 128, dupe_factor, 0.1, 0.15, 20,
                                              random.Random(seed))
    out = window_stats(windows, fallbacks[0])
    out.update(instances=len(instances), seconds=round(time.time() - t0, 1),
               random_next_labels=sum(1 for x in instances if x.is_random_next))
    return out


def run_ours_negatives(inp: Path, outdir: Path, dupe_factor: int) -> dict:
    cmd = [sys.executable, "-m", "bertdist.cli.main", "data", "build", "--input", f"text:{inp}",
           "--vocab", str(SHARED / "vocab" / "bert-base-uncased-vocab.txt"), "--output", str(outdir),
           "--set", "max_seq_length=128", "--set", f"dupe_factor={dupe_factor}", "--set", "heldout_fraction=0",
           "--set", "num_shards=4", "--runner=DirectRunner", "--direct_running_mode=in_memory",
           "--direct_num_workers=1"]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"build failed ({r.returncode}):\n{r.stderr[-3000:]}")
    man = json.loads((outdir / "manifest.json").read_text())
    return {**man["negatives"]["train"], "instances": man["counts"]["instances"], "seconds": round(time.time() - t0, 1),
            "documents": man["counts"]["documents"], "buckets": man["negatives"]["buckets"]["train"]}


def negatives_main(args) -> int:
    reference = Path(args.reference).resolve()
    if not reference.is_file() or not (reference.parent / "tokenization.py").is_file():
        raise SystemExit(f"--reference {reference}: expected create_pretraining_data.py with tokenization.py beside it")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        inp = Path(tmp) / "shared_corpus.txt"
        corpus = make_shared_corpus(inp)
        print(json.dumps({"input": corpus}), flush=True)
        for dupe in (int(d) for d in args.dupes.split(",")):
            ours = run_ours_negatives(inp, Path(tmp) / f"ours_d{dupe}", dupe)
            theirs = run_reference_negatives(reference, inp, dupe)
            r = {"dupe_factor": dupe, "ours": ours, "reference": theirs,
                 "load_average": [round(x, 2) for x in os.getloadavg()]}
            results.append(r)
            print(json.dumps(r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"input": corpus, "results": results}, indent=2) + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--negatives", action="store_true",
                    help="compare NSP negative diversity with the reference (needs --reference)")
    ap.add_argument("--reference", help="path to NVIDIA's create_pretraining_data.py (a copy outside the project)")
    ap.add_argument("--dupes", default="1", help="--negatives: dupe factors to compare")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--mode", choices=("multi_processing", "in_memory"), default="multi_processing",
                    help="in_memory: the whole pipeline in one process on one core (--workers is 1)")
    ap.add_argument("--scales", default="1,5")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.negatives:
        if not args.reference:
            ap.error("--negatives needs --reference PATH")
        return negatives_main(args)
    if args.mode == "in_memory":
        args.workers = 1
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for scale in (int(s) for s in args.scales.split(",")):
            inp = Path(tmp) / f"books_x{scale}.txt"
            words = make_bert_format(inp, scale)
            r = run_once(inp, Path(tmp) / f"out_x{scale}", args.workers, args.mode)
            r.update(scale=scale, workers=args.workers, mode=args.mode, input_words=words,
                     words_per_s_per_core=round(words / r["wall_s"] / args.workers),
                     words_per_cpu_s=round(words / r["cpu_s"]) if r["cpu_s"] else None)
            r["x_reference_per_core"] = round(r["words_per_s_per_core"] / REFERENCE_WORDS_PER_S, 2)
            results.append(r)
            print(json.dumps(r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
