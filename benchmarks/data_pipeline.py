"""Data pipeline benchmark (not a test): our build and the reference, side by side.

Workload (the reference figure in ../shared/data/README.md): the 14 Gutenberg books split into
sentences (blingfire) in BERT format, max_seq_length 128, dupe_factor 5, masked_lm_prob 0.15,
max_predictions_per_seq 20, uncased BERT vocab, at 1x and 5x (the books, then copies of them whose
words go through a per-copy bijection within word-length and frequency classes: the same amount
of work, no duplicates; see ``make_bert_format``).

The default mode runs, on the same input file and interleaved (one repeat = the reference, then
each of our configurations), with ``--repeats`` repeats per input scale:

- the reference: NVIDIA's PyTorch port of google-research's create_pretraining_data.py
  (``--reference``, default ../shared/reference/nvidia-bert-create-pretraining-data/; used from
  there, never copied), its whole program as its README runs it (text file in, HDF5 file out),
  in a process of its own, one core. Its ``create_training_instances`` (read, tokenize, make
  every instance in memory) and ``write_instance_to_example_file`` (HDF5) are timed inside too;
- ours: ``bertdist data build`` on the DirectRunner, 1 worker (``in_memory``, one process) and 2
  workers (``multi_processing``), with dedup off and on (``dedup.enabled``).

Both programs are timed whole, from outside (``wait4``: wall, CPU of the process and its
children, peak RSS). It reports input words/s per core (the reference uses one) and, per repeat,
ours / reference: whole program against whole program (the main figure), and our whole program
against the reference's ``create_training_instances`` alone (stricter: its start-up and writing
left out, ours kept in). The summary gives each ratio's median and its range over the repeats.
The reference needs ``h5py`` and ``tqdm``: ``pip install -e .[bench-data]``.

    .venv/bin/python benchmarks/data_pipeline.py [--scales 1,5] [--repeats 3,2] [--workers 1,2] \
        [--dedup off,on] [--json out.json] [--markdown results.md]

NSP negative diversity against the reference, on the same input (``--negatives``): the shared
corpus (the Wikipedia fragment's articles and the 14 books, parsed and split into sentences by
this pipeline) written once in BERT format; ``bertdist data build`` on it (no held-out split,
seq 128, the given dupe factors) and the reference on the same file, same settings. For each:
random-next rows, distinct (document, start sentence) windows of their B segments, the largest
reuse and the same-document fallbacks. The reference is instrumented from outside, unchanged: its
``create_instances_from_document`` is wrapped so that ``all_documents`` records the first
sentence read from every random document (``random_document[random_start]``).

    .venv/bin/python benchmarks/data_pipeline.py --negatives [--dupes 1,5] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("BERTDIST_SHARED_DATA", REPO.parent / "shared" / "data"))
REFERENCE = REPO.parent / "shared" / "reference" / "nvidia-bert-create-pretraining-data" / "create_pretraining_data.py"
VOCAB = SHARED / "vocab" / "bert-base-uncased-vocab.txt"


WORD = re.compile(r"[A-Za-z]+")
BLOCK = 16  # words of one length per block of the frequency ranking: a word's stand-ins are about as frequent


def copy_maps(text: str, copies: int) -> list[dict[str, str]]:
    """For copy k = 1..copies-1, a bijection of the text's words (lower-cased ASCII letter runs)
    onto themselves that keeps every word's length: the words of one length, ranked by frequency
    (ties alphabetical), are cut into blocks of ``BLOCK`` consecutive ranks (a short last block
    joins the one before), and copy k maps the j-th word of a block to the (j + k)-th, cyclically.
    So copy k has the same words per line, characters per word and word-frequency spectrum as
    the original, with no word left in place where its block is larger than k (every block but
    those of the rare lengths a block's worth of words never fills), and two copies share no
    mapping where the block is larger than their k's difference: no copy repeats another's word
    n-grams, which is what the near-duplicate detection measures."""
    from collections import Counter

    freq = Counter(w.lower() for w in WORD.findall(text))
    by_len: dict[int, list[str]] = {}
    for w, _ in sorted(freq.items(), key=lambda kv: (-kv[1], kv[0])):
        by_len.setdefault(len(w), []).append(w)
    maps: list[dict[str, str]] = [{} for _ in range(copies)]
    for words in by_len.values():
        starts = list(range(0, len(words), BLOCK))
        if len(starts) > 1 and len(words) - starts[-1] < BLOCK:
            starts.pop()  # the short tail joins the block before
        for a, b in zip(starts, starts[1:] + [len(words)]):
            block = words[a:b]
            for k in range(1, copies):
                maps[k].update((w, block[(j + k) % len(block)]) for j, w in enumerate(block))
    return maps


def _apply(text: str, mapping: dict[str, str]) -> str:
    """Each word replaced by its image, its letters' case kept position by position."""
    def sub(m: re.Match) -> str:
        w = m.group(0)
        new = mapping[w.lower()]
        return new if w.islower() else "".join(c.upper() if o.isupper() else c for c, o in zip(new, w))

    return WORD.sub(sub, text)


def make_bert_format(out: Path, scale: int) -> int:
    """Books -> one sentence per line, blank line between documents; ``scale`` copies: the books
    themselves, then ``scale - 1`` copies whose words go through :func:`copy_maps`' bijections,
    so that each copy is as much work as the books (same words, lines, word lengths and word
    frequencies) and none is a duplicate of another (a build with dedup on removes nothing:
    :func:`check_no_duplicates`). Returns words."""
    sys.path.insert(0, str(REPO))
    from data_pipeline.text import text_to_sentences

    docs = []
    for p in sorted((SHARED / "books").glob("*.txt")):
        docs.append("\n".join(text_to_sentences(p.read_text(encoding="utf-8", errors="replace"))))
    body = "\n\n".join(docs) + "\n"
    maps = copy_maps(body, scale)
    with out.open("w") as f:
        for i in range(scale):
            f.write((_apply(body, maps[i]) if i else body) + "\n")
    return len(body.split()) * scale


def documents_removed(manifest: dict) -> int:
    """Documents a build's dedup removed, all sources."""
    return sum((d.get(k) or 0) for d in manifest["dedup"]["sources"].values()
               for k in ("exact_documents_removed", "near_documents_removed"))


def check_no_duplicates(result: dict, scale: int) -> None:
    """Raise when a build with dedup on removed documents: the scaled input would then measure
    less work than its size says."""
    if result["dedup_documents_removed"]:
        raise SystemExit(f"the {scale}x input has duplicates: a dedup-on build removed "
                         f"{result['dedup_documents_removed']} documents")


def run_once(inp: Path, outdir: Path, workers: int, mode: str, extra_sets: tuple[str, ...] = ()) -> dict:
    cmd = [sys.executable, "-m", "bertdist.cli.main", "data", "build", "--input", f"text:{inp}",
           "--vocab", str(VOCAB), "--output", str(outdir),
           "--set", "max_seq_length=128", "--set", "dupe_factor=5", "--set", "masked_lm_prob=0.15",
           "--set", "max_predictions_per_seq=20", "--set", "num_shards=8",
           *(a for kv in extra_sets for a in ("--set", kv)),
           "--runner=DirectRunner", f"--direct_running_mode={mode}", f"--direct_num_workers={workers}"]
    wall, cpu, _, peak = timed_process(cmd, outdir.parent / f"{outdir.name}.log", sample_rss=True)
    man = json.loads((outdir / "manifest.json").read_text())
    workers_rss = sorted((r for k, r in peak.values() if k == "worker"), reverse=True)
    driver_rss = max((r for k, r in peak.values() if k == "driver"), default=0)
    return {"wall_s": round(wall, 2), "pipeline_wall_s": man["wall_seconds"], "cpu_s": round(cpu, 2),
            "instances": man["counts"]["instances"], "input_words_counted": man["counts"]["input_words"],
            "dedup_documents_removed": documents_removed(man),
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


def load_reference(reference: Path, *, writes: bool = False):
    """NVIDIA's create_pretraining_data.py, unchanged, loaded from where it lies. Its
    tokenization.py imports ``file_utils`` (downloads, not shipped with it, unused for a local
    vocab): a stand-in gives back the path. ``writes``: its HDF5 output will be written, so the
    real ``h5py`` is needed; otherwise a stand-in takes its place when it is not installed."""
    import importlib.util
    import types

    sys.path.insert(0, str(reference.parent))  # its tokenization.py
    sys.modules.setdefault("file_utils", types.SimpleNamespace(cached_path=lambda path, cache_dir=None: path))
    missing = [m for m in ("h5py", "tqdm") if importlib.util.find_spec(m) is None]
    if missing and writes:
        raise SystemExit(f"the reference's whole program needs {' and '.join(missing)}: pip install -e .[bench-data]")
    if "h5py" in missing:  # imported at its top, unused without writing
        sys.modules["h5py"] = types.SimpleNamespace()
    spec = importlib.util.spec_from_file_location("reference_cpd", reference)
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    return ref


REFERENCE_SETTINGS = ("--max_seq_length", "128", "--dupe_factor", "5", "--max_predictions_per_seq", "20",
                      "--masked_lm_prob", "0.15", "--random_seed", "12345")


def reference_program(reference: Path, inp: Path, output: Path) -> dict:
    """In this process (started for it alone, timed whole from outside): the reference's own
    ``main()``, with the command line of its README and the benchmark's settings. Its two phases
    are timed inside by wrapping them (the module is otherwise unchanged)."""
    import resource

    ref = load_reference(reference, writes=True)
    phases: dict = {}

    def timed(name, fn):
        def run(*args, **kwargs):
            usage = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            after = resource.getrusage(resource.RUSAGE_SELF)
            phases[f"{name}_s"] = round(time.perf_counter() - t0, 2)
            phases[f"{name}_cpu_s"] = round(after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime, 2)
            if name == "instances":
                phases["instances"] = len(result)
            return result
        return run

    ref.create_training_instances = timed("instances", ref.create_training_instances)
    ref.write_instance_to_example_file = timed("write", ref.write_instance_to_example_file)
    sys.argv = [str(reference), "--input_file", str(inp), "--output_file", str(output), "--vocab_file", str(VOCAB),
                "--do_lower_case", *REFERENCE_SETTINGS]
    ref.main()
    return phases


def timed_process(cmd: list[str], log: Path, sample_rss: bool = False) -> tuple[float, float, int, dict]:
    """Run ``cmd`` with its output in ``log``: (wall s, CPU s of it and every process it started
    and reaped, its peak RSS in MB, {pid: (kind, peak RSS bytes)} sampled every 100 ms when
    ``sample_rss``). ``wait4`` gives the exact end (a polling loop would add up to its period)."""
    import psutil  # here: the reference's own process (started from this file) does not load it

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
        if sample_rss:
            sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.time() - t0
        done.set()
        if sample_rss:
            sampler.join()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{cmd[:4]} failed ({os.waitstatus_to_exitcode(status)}):\n{log.read_text()[-3000:]}")
    return wall, usage.ru_utime + usage.ru_stime, round(usage.ru_maxrss / 1024), peak


def run_reference(reference: Path, inp: Path, workdir: Path) -> dict:
    """The reference's whole program in a process of its own: wall, CPU and peak RSS of the
    process, and the seconds of its two phases (see :func:`reference_program`)."""
    output = workdir / "reference.hdf5"
    log = workdir / "reference.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--reference-program", str(inp), "--reference", str(reference),
           "--reference-output", str(output)]
    wall, cpu, rss, _ = timed_process(cmd, log)
    phases = json.loads(log.read_text().strip().splitlines()[-1])
    hdf5_bytes = output.stat().st_size
    output.unlink()
    # startup_s: the rest of its wall time (interpreter start, imports, vocab loading, and the
    # exit, which frees every instance: about 2.6 s of it at 5x)
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), **phases,
            "startup_s": round(wall - phases["instances_s"] - phases["write_s"], 2),
            "hdf5_bytes": hdf5_bytes, "peak_rss_mb": rss}


def run_reference_negatives(reference: Path, inp: Path, dupe_factor: int, seed: int = 12345) -> dict:
    """NVIDIA's create_pretraining_data.py (unchanged) on ``inp``, with its random documents recorded."""
    import random

    ref = load_reference(reference)
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
    tokenizer = ref.BertTokenizer(str(VOCAB), do_lower_case=True)
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


def spread(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median": round(statistics.median(xs), 2), "min": round(xs[0], 2), "max": round(xs[-1], 2), "n": len(xs)}


# per repeat, ours / the reference (each a ratio of input words/s per core, or of CPU seconds)
RATIOS = {
    # whole program against whole program: text file in, training files out
    "x_reference_per_core": lambda ref, ours, w: ref["wall_s"] / ours["wall_s"] / w,
    # our whole program against the reference's create_training_instances alone (its start-up and
    # HDF5 writing left out, ours kept in): the stricter figure
    "x_reference_instances_per_core": lambda ref, ours, w: ref["instances_s"] / ours["wall_s"] / w,
    # CPU seconds, all our processes together: less moved than wall time by other jobs
    "x_reference_per_cpu_s": lambda ref, ours, w: ref["cpu_s"] / ours["cpu_s"],
    # both after start-up: ours from data_pipeline.pipeline.run (after the interpreter and the
    # Beam import), the reference's two phases (after its imports and vocab loading)
    "x_reference_per_core_after_startup":
        lambda ref, ours, w: (ref["instances_s"] + ref["write_s"]) / ours["pipeline_wall_s"] / w,
}


def compare_main(args) -> int:
    """The reference and our configurations, interleaved, ``args.repeats`` times per scale."""
    reference = Path(args.reference).resolve()
    code_at_start = code_state()
    configs = [(w, d) for w in (int(x) for x in args.workers.split(",")) for d in args.dedup.split(",")]
    runs, summary = [], []
    with tempfile.TemporaryDirectory() as tmp:
        scales = [int(s) for s in args.scales.split(",")]
        repeats = [int(r) for r in args.repeats.split(",")]
        repeats += repeats[-1:] * (len(scales) - len(repeats))
        for scale, n_repeats in zip(scales, repeats):
            inp = Path(tmp) / f"books_x{scale}.txt"
            words = make_bert_format(inp, scale)
            for rep in range(n_repeats):
                ref = run_reference(reference, inp, Path(tmp))
                row = {"scale": scale, "repeat": rep, "input_words": words, "reference": ref,
                       "reference_words_per_s": round(words / ref["wall_s"]), "ours": [],
                       "load_average": [round(x, 2) for x in os.getloadavg()]}
                for workers, dedup in configs:
                    mode = "in_memory" if workers == 1 else "multi_processing"
                    out = Path(tmp) / f"out_x{scale}_w{workers}_{dedup}"
                    r = run_once(inp, out, workers, mode, (f"dedup.enabled={'true' if dedup == 'on' else 'false'}",))
                    shutil.rmtree(out, ignore_errors=True)
                    if dedup == "on":
                        check_no_duplicates(r, scale)
                    r.update(workers=workers, dedup=dedup, mode=mode, words_per_s_per_core=round(words / r["wall_s"] / workers),
                             **{k: round(f(ref, r, workers), 2) for k, f in RATIOS.items()})
                    row["ours"].append(r)
                runs.append(row)
                print(json.dumps(row), flush=True)
            rows = [row for row in runs if row["scale"] == scale]
            for workers, dedup in configs:
                ours = [o for row in rows for o in row["ours"] if (o["workers"], o["dedup"]) == (workers, dedup)]
                summary.append({"scale": scale, "workers": workers, "dedup": dedup,
                                **{k: spread([o[k] for o in ours]) for k in RATIOS},
                                "ours_wall_s": spread([o["wall_s"] for o in ours]),
                                "reference_wall_s": spread([row["reference"]["wall_s"] for row in rows]),
                                "reference_instances_s": spread([row["reference"]["instances_s"] for row in rows])})
    for s_ in summary:
        print(json.dumps(s_), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary}, indent=2) + "\n")
    if args.markdown:
        write_markdown(Path(args.markdown), runs, summary, args, code_at_start)
    return 0


CODE_PATHS = ("data_pipeline", "csrc/data_pipeline", "bertdist/data", "bertdist/config")


def code_state() -> str:
    """The commit, and the uncommitted changes (with a hash of their diff) in the build's code."""
    def git(*a):
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=REPO).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--short", "--", *CODE_PATHS)
    if not dirty:
        return f"`{head}`"
    import hashlib

    digest = hashlib.sha256(git("diff", "HEAD", "--", *CODE_PATHS).encode()).hexdigest()[:12]
    return (f"`{head}` plus uncommitted changes (diff sha256 {digest}) in `"
            + "`, `".join(line.strip() for line in dirty.splitlines()) + "`")


def write_markdown(path: Path, runs: list, summary: list, args, code_at_start: str) -> None:
    code_at_end = code_state()
    code = (f"{code_at_end} throughout" if code_at_end == code_at_start else
            f"at the start {code_at_start}; at the end {code_at_end} (the code changed during the run)")
    lines = [f"# Data pipeline vs the reference, side by side (CPU), {time.strftime('%Y-%m-%d', time.gmtime())}", "",
             f"- **Device**: 2-core CPU VM ({os.cpu_count()} logical cores), no GPU; load average at the end "
             f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}.",
             f"- **Date**: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
             f"- **Code**: {code}.",
             f"- **Command**: `.venv/bin/python benchmarks/data_pipeline.py --scales {args.scales} --repeats {args.repeats} "
             f"--workers {args.workers} --dedup {args.dedup} --markdown {path.as_posix()}`",
             "- **Workload**: the 14 shared books in BERT format x scale, seq 128, dupe 5, masked_lm_prob 0.15, "
             "20 predictions per sequence, uncased BERT vocab; ours also 8 train shards, the held-out split and the "
             "manifest. Each repeat runs the reference, then each of our configurations, on the same file.",
             "- **Reference**: NVIDIA's port of google-research's create_pretraining_data.py, unchanged, its whole "
             "program as its README runs it (text file in, one HDF5 file out), in its own process on one core; "
             "its `create_training_instances` (read, tokenize, make every instance in memory) and "
             "`write_instance_to_example_file` are timed inside. Ours: the whole `bertdist data build` process. "
             "Both processes are timed from outside (wall time, CPU time of the process and its children).",
             "- **Ratios**, per repeat, as input words/s per core, ours / the reference's: *whole programs*, the "
             "main figure; *against its instance creation alone*, our whole program against the reference's "
             "`create_training_instances` (its start-up and HDF5 writing left out, ours kept in: the stricter "
             "figure); *by CPU time*, the reference's CPU seconds / ours (all our processes together), the "
             "steadier one when other jobs share the machine; *after start-up*, ours from the start of "
             "`data_pipeline.pipeline.run` (the manifest's `wall_seconds`: after the interpreter and the Beam "
             "import, still counting vocab loading, pipeline construction and the commit) and the reference's "
             "two phases (after its imports and vocab loading).", "",
             "## Summary: ours / reference, per core (median, range over the repeats)", "",
             "| input | our workers | dedup | x reference per core, whole programs | x its instance creation alone "
             "| x by CPU time | x after start-up | our wall s | reference wall s (its instance creation s) | repeats |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def cell(x: dict) -> str:
        return f"{x['median']} ({x['min']}–{x['max']})"

    for s_ in summary:
        x = s_["x_reference_per_core"]
        lines.append(f"| {s_['scale']}x | {s_['workers']} | {s_['dedup']} | **{cell(x)}** "
                     f"| {cell(s_['x_reference_instances_per_core'])} | {cell(s_['x_reference_per_cpu_s'])} "
                     f"| {cell(s_['x_reference_per_core_after_startup'])} | {cell(s_['ours_wall_s'])} "
                     f"| {cell(s_['reference_wall_s'])} ({cell(s_['reference_instances_s'])}) | {x['n']} |")
    lines += ["", "## Raw runs (one JSON line per repeat)", "", "```"]
    lines += [json.dumps(row) for row in runs]
    lines += ["```", ""]
    path.write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--negatives", action="store_true",
                    help="compare NSP negative diversity with the reference (needs --reference)")
    ap.add_argument("--reference", default=str(REFERENCE),
                    help="NVIDIA's create_pretraining_data.py, with its tokenization.py beside it (used from there)")
    ap.add_argument("--reference-program", metavar="INPUT", help=argparse.SUPPRESS)  # the reference's own process
    ap.add_argument("--reference-output", metavar="HDF5", help=argparse.SUPPRESS)
    ap.add_argument("--dupes", default="1", help="--negatives: dupe factors to compare")
    ap.add_argument("--workers", default="1,2", help="our worker counts (1: in_memory, one process)")
    ap.add_argument("--dedup", default="off,on", help="our dedup settings (dedup.enabled)")
    ap.add_argument("--repeats", default="3", help="interleaved repeats per scale (one number, or one per scale)")
    ap.add_argument("--scales", default="1,5")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--markdown", help="write a results file here (benchmarks/results/...)")
    args = ap.parse_args()
    if args.reference_program:
        phases = reference_program(Path(args.reference), Path(args.reference_program), Path(args.reference_output))
        print(json.dumps(phases), flush=True)
        return 0
    if args.negatives:
        return negatives_main(args)
    return compare_main(args)


if __name__ == "__main__":
    sys.exit(main())
