"""Data pipeline throughput and memory benchmark (not a test).

Workload (the reference figure in ../shared/data/README.md): the 14 Gutenberg books split into
sentences (blingfire) in BERT format, max_seq_length 128, dupe_factor 5, masked_lm_prob 0.15,
max_predictions_per_seq 20, uncased BERT vocab. Runs ``bertdist data build`` on the DirectRunner
(multi_processing) and reports input words/s per core, wall time, and peak RSS per process
(driver/runner and each SDK worker), for the corpus at 1x and 5x.

    .venv/bin/python benchmarks/data_pipeline.py [--workers N] [--scales 1,5] [--json out.json]
    .venv/bin/python benchmarks/data_pipeline.py --mode in_memory   # one process, one core
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--mode", choices=("multi_processing", "in_memory"), default="multi_processing",
                    help="in_memory: the whole pipeline in one process on one core (--workers is 1)")
    ap.add_argument("--scales", default="1,5")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
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
