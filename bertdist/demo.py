"""`make demo`: the whole chain on bundled real text (data_pipeline/samples), through the CLI.

Stages, each run as the user would type it and timed:
  1. vocab     `bertdist data vocab`   WordPiece vocab trained on the bundled books and wiki sample
  2. data      `bertdist data build`   Beam (DirectRunner, multi-processing) -> Parquet shards + manifest
  3. pretrain  `torchrun --nproc_per_node N -m bertdist.cli.main pretrain`  DeepSpeed on N local ranks:
               one per visible GPU with CUDA (NCCL), else 2 CPU ranks (gloo) (``local_ranks``)
  4. export    `bertdist export`       Hugging Face directory; fill-mask top-5 before vs after
  5. finetune  `bertdist finetune sst2` on a small real classification task built from the
               bundled books (which of two authors wrote a sentence), in SST-2's TSV layout
  6. summary   wall time per stage, throughput, final metrics, artifacts, curves PNG
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "data_pipeline" / "samples"
INPUTS = [f"wiki:{SAMPLES / 'wiki'}", f"books:{SAMPLES / 'books'}"]
FILL_MASK_PROBES = [
    "the man who was [MASK] .",
    "she could not [MASK] him .",
    "it was a [MASK] day .",
    "the king of [MASK] .",
]


class Stages:
    """Times each stage and keeps a one-line result for the summary."""

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


def sh(*cmd: str, env: dict | None = None) -> None:
    """Run a command as the user would, echoing it; fail the demo if it fails."""
    print("$ " + " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, env={**os.environ, **(env or {})}, cwd=REPO)


def bertdist(*args: str) -> None:
    sh(sys.executable, "-m", "bertdist.cli.main", *args)


def stage_vocab(out: Path):
    vocab = out / "vocab.txt"
    bertdist("data", "vocab", *sum((["--input", i] for i in INPUTS), []), "--output", str(vocab), "--size", "4000")
    n = sum(1 for _ in vocab.open(encoding="utf-8"))
    return vocab, f"{n} WordPiece tokens -> {vocab}"


def stage_data(out: Path, vocab: Path):
    records = out / "records"
    bertdist("data", "build", *sum((["--input", i] for i in INPUTS), []), "--vocab", str(vocab),
             "--output", str(records), "--config", str(REPO / "configs/data/tiny_demo.yaml"), "--set", "dupe_factor=3")
    from bertdist.data import open_records

    train = open_records(records / "manifest.json")  # verifies every shard's checksum
    c = train.manifest["counts"]
    return records / "manifest.json", (
        f"{c['documents']} documents, {c['sentences']} sentences, {c['input_words']:,} words -> "
        f"{c['instances']:,} instances ({train.num_rows:,} train rows in {len(train.shards)} shards), "
        f"{c['masked_fraction']:.1%} masked, {c['random_next_fraction']:.1%} random-next")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The tiny recipe's micro batch (configs/pretrain/tiny.yaml); the global batch follows the rank count.
DEMO_MICRO_BATCH = 16


def local_ranks() -> tuple[int, str]:
    """(processes, why): one per visible GPU when CUDA is present (each rank binds to
    cuda:LOCAL_RANK, so a second rank on a one-GPU machine would fail), else 2 CPU ranks."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        n = torch.cuda.device_count()
        return n, f"{n} visible CUDA device{'s' if n > 1 else ''}, one rank each (NCCL)"
    return 2, "no CUDA device: 2 CPU ranks (gloo)"


def demo_global_batch(ranks: int, micro: int = DEMO_MICRO_BATCH) -> int:
    """The recipe's 32 sequences per step where the ranks divide it, else one micro batch per rank."""
    return micro * ranks * max(1, 2 // ranks)


DEMO_MARK = ".made-by-bertdist-demo"


def fresh_run_dir(run_dir: Path) -> Path:
    """An empty ``run_dir``: an earlier demo's run is replaced (the demo marked it as its own);
    a folder the demo did not make is never deleted."""
    if run_dir.exists():
        if not (run_dir / DEMO_MARK).is_file():
            raise SystemExit(f"{run_dir} exists and was not made by the demo: not deleting it. Move it away or "
                             "choose another --out.")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / DEMO_MARK).write_text("this run directory is replaced by the next `make demo` with the same --out\n")
    return run_dir


def stage_pretrain(out: Path, manifest: Path, vocab: Path, steps: int, ranks: int):
    run_dir = fresh_run_dir(out / "pretrain")
    every = max(steps // 4, 1)
    sh(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1",
       "--master_port", str(_free_port()), "-m", "bertdist.cli.main", "pretrain",
       str(REPO / "configs/pretrain/tiny.yaml"), f"run_dir={run_dir}", f"data.train_manifest={manifest}",
       f"data.vocab_file={vocab}", f"schedule.total_steps={steps}", f"schedule.warmup_steps={max(steps // 20, 1)}",
       f"data.micro_batch_size={DEMO_MICRO_BATCH}", f"data.global_batch_size={demo_global_batch(ranks)}",
       f"checkpoint.every_steps={every}", f"eval.every_steps={every}", "logging.progress=none",
       env={"OMP_NUM_THREADS": "1"})
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [m for m in metrics if "loss" in m and m.get("kind", "train") == "train"]
    evals = [m for m in metrics if m.get("kind") == "eval"]
    last_eval = evals[-1] if evals else {}
    tput = [m["seq_per_s"] for m in train if "seq_per_s" in m]
    line = (f"{len(train)} logged steps, loss {train[0]['loss']:.2f} -> {train[-1]['loss']:.2f}"
            + (f", held-out MLM acc {last_eval.get('mlm_acc', float('nan')):.3f}" if last_eval else "")
            + (f", {sum(tput) / len(tput):.0f} seq/s" if tput else ""))
    return (run_dir, metrics), line


def _fill_mask(model_dir: Path, vocab: Path) -> list[list[str]]:
    from transformers import pipeline

    fill = pipeline("fill-mask", model=str(model_dir), tokenizer=str(model_dir), device=-1)
    return [[p["token_str"] for p in fill(text, top_k=5)] for text in FILL_MASK_PROBES]


def stage_export(out: Path, run_dir: Path, vocab: Path):
    import torch
    import yaml

    from bertdist.export import write_hf_dir  # the same writer `bertdist export` uses
    from bertdist.model import BertConfig, BertForPreTraining

    hf_dir = out / "hf"
    bertdist("export", str(run_dir), "--out", str(hf_dir))
    # "Before": the same architecture at its initialisation (the trainer's seed), exported alike.
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    cfg = BertConfig.from_mapping({**resolved["model"], "vocab_size": sum(1 for _ in vocab.open())})
    torch.manual_seed(resolved.get("seed", 0))
    init_dir = out / "hf_init"
    write_hf_dir(init_dir, cfg, BertForPreTraining(cfg).state_dict(), vocab)
    before, after = _fill_mask(init_dir, vocab), _fill_mask(hf_dir, vocab)
    for text, b, a in zip(FILL_MASK_PROBES, before, after):
        print(f"  {text!r}\n    before: {b}\n    after:  {a}")
    return hf_dir, f"HF directory {hf_dir} (fill-mask works; top-5 shown before/after pretraining)"


def build_author_task(out: Path, per_class: int = 1200) -> Path:
    """A real 2-class task from the bundled books: was this sentence written by Austen (0) or Chesterton (1)?

    Written in GLUE SST-2's layout (sentence<TAB>label with a header) so the stock `sst2` task reads it.
    """
    import blingfire

    task = out / "author_task"
    task.mkdir(parents=True, exist_ok=True)
    rows = []
    for label, name in ((0, "austen-persuasion.txt"), (1, "chesterton-thursday.txt")):
        text = " ".join((SAMPLES / "books" / name).read_text(encoding="utf-8").split())
        sents = [s for s in blingfire.text_to_sentences(text).split("\n") if 6 <= len(s.split()) <= 40]
        rng = random.Random(label)
        rng.shuffle(sents)
        rows += [(s.replace("\t", " "), label) for s in sents[:per_class]]
    random.Random(0).shuffle(rows)
    n_dev = len(rows) // 6
    for split, part in (("dev", rows[:n_dev]), ("train", rows[n_dev:])):
        with (task / f"{split}.tsv").open("w", encoding="utf-8") as f:
            f.write("sentence\tlabel\n")
            f.writelines(f"{s}\t{y}\n" for s, y in part)
    return task


def stage_finetune(out: Path, hf_dir: Path, vocab: Path):
    task = build_author_task(out)
    ft_dir = out / "finetune"
    bertdist("finetune", "sst2", "--checkpoint", str(hf_dir), "--data", str(task), "--out", str(ft_dir),
             "--vocab", str(vocab), "--set", "epochs=3", "--set", "max_seq_length=64", "--set", "learning_rate=5e-4",
             "--set", "progress=false")
    metrics = json.loads((ft_dir / "metrics.json").read_text())
    best = metrics["best"]["metrics"]["dev"]
    base = (metrics.get("majority_baseline") or {}).get("dev", {})
    line = f"author task dev accuracy {best['accuracy']:.3f}"
    if base:
        line += f" (majority class {base['accuracy']:.3f})"
    return metrics, line


def heldout_nsp_note(manifest: Path) -> str:
    """Why held-out NSP is not measured ("" when it is): a held-out split of fewer documents than
    the data build's floor (its warning says so) takes its negatives from too few documents."""
    held = json.loads(manifest.read_text())["heldout"]
    if held["documents"] >= held["min_documents"]:
        return ""
    return (f"held-out NSP not measured: the bundled sample's held-out split has {held['documents']} documents, "
            f"fewer than the {held['min_documents']} that NSP needs (its negatives come from held-out documents only)")


def plot_curves(metrics: list[dict], png: Path, ranks: int = 2, nsp_note: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [m for m in metrics if "loss" in m and m.get("kind", "train") == "train"]
    evals = [m for m in metrics if m.get("kind") == "eval"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.plot([m["step"] for m in train], [m["loss"] for m in train], label="train loss (MLM + NSP)")
    if evals and "mlm_loss" in evals[0]:
        ax1.plot([m["step"] for m in evals], [m["mlm_loss"] for m in evals], "o-", label="held-out MLM loss")
    ax1.set_xlabel("step")
    ax1.set_title(f"pretraining loss (tiny, {ranks} rank{'s' if ranks > 1 else ''})")
    ax1.legend()
    for key, label in (("mlm_acc", "held-out MLM accuracy"), ("nsp_acc", "held-out NSP accuracy")):
        if evals and key in evals[0] and not (key == "nsp_acc" and nsp_note):
            ax2.plot([m["step"] for m in evals], [m[key] for m in evals], "o-", label=label)
    if nsp_note:  # say so instead of plotting noise
        ax2.text(0.98, 0.04, "held-out NSP not measured: too few\nheld-out documents (see the data build)",
                 transform=ax2.transAxes, fontsize=8, color="gray", ha="right")
    ax2.set_xlabel("step")
    ax2.set_title("held-out evaluation")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return png


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="demo_out", help="where artifacts go")
    ap.add_argument("--steps", type=int, default=1500, help="pretraining steps")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    stages = Stages()
    vocab = stages.run("1. vocab", stage_vocab, out)
    manifest = stages.run("2. data (Beam)", stage_data, out, vocab)
    ranks, why = local_ranks()
    print(f"pretraining ranks: {why}", flush=True)
    run_dir, metrics = stages.run(f"3. pretrain (DeepSpeed, {ranks} rank{'s' if ranks > 1 else ''})", stage_pretrain,
                                  out, manifest, vocab, args.steps, ranks)
    hf_dir = stages.run("4. export (Hugging Face)", stage_export, out, run_dir, vocab)
    ft = stages.run("5. finetune", stage_finetune, out, hf_dir, vocab)
    nsp_note = heldout_nsp_note(manifest)
    png = plot_curves(metrics, out / "pretrain_curves.png", ranks, nsp_note)
    print("\n=== summary")
    for name, dt, line in stages.rows:
        print(f"  {name:<34} {dt:7.1f} s  {line}")
    if nsp_note:
        print(f"  {nsp_note}")
    print(f"  {'total':<34} {time.perf_counter() - t0:7.1f} s")
    print(f"  artifacts: vocab {vocab}\n             records {manifest.parent}\n             run {run_dir}"
          f" (checkpoints, TensorBoard, metrics.jsonl)\n             HF model {hf_dir}\n"
          f"             fine-tune {out / 'finetune'}\n             curves {png}")
    (out / "summary.json").write_text(json.dumps(
        {"stages": [{"name": n, "seconds": round(d, 1), "result": r} for n, d, r in stages.rows],
         "finetune": ft.get("best")}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
