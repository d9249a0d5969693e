"""The teacher and the student side by side: dev metric and retention (student / teacher),
parameters, size on disk, and speed (latency at batch 1, throughput at batch 32, at the same
sequence length), timed in the same process and interleaved (teacher, student, teacher, ...) so
that load on a shared machine hits both alike; CPU always, the GPU too where there is one.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from bertdist.model.bert import count_parameters


def dir_size_bytes(d: str | Path | None) -> int | None:
    """Bytes of the weight files of a model directory (what serving loads)."""
    if d is None:
        return None
    p = Path(d)
    return sum(f.stat().st_size for f in p.iterdir() if f.suffix in (".safetensors", ".bin", ".pt"))


def _inputs(batch: int, seq: int, vocab: int, device) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(min(1000, vocab // 2), vocab, (batch, seq), generator=g)  # past the special tokens
    return {"input_ids": ids.to(device), "token_type_ids": torch.zeros_like(ids).to(device),
            "attention_mask": torch.ones_like(ids).to(device)}


@torch.no_grad()
def time_models(models: dict[str, torch.nn.Module], vocab: int, seq: int, device: torch.device,
                repeats: int = 5) -> dict[str, dict]:
    """Median seconds of a batch-1 forward (latency) and sequences/s at batch 32, per model."""
    out = {name: {"latency_b1_ms": [], "throughput_b32": []} for name in models}
    one, many = _inputs(1, seq, vocab, device), _inputs(32, seq, vocab, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for m in models.values():  # warm-up
        m.eval()
        m(one)
        m(many)
    for _ in range(repeats):
        for name, m in models.items():
            sync()
            t = time.perf_counter()
            m(one)
            sync()
            out[name]["latency_b1_ms"].append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            m(many)
            sync()
            out[name]["throughput_b32"].append(32 / (time.perf_counter() - t))
    return {name: {"latency_b1_ms": round(statistics.median(v["latency_b1_ms"]), 2),
                   "throughput_b32_seq_per_s": round(statistics.median(v["throughput_b32"]), 1),
                   "repeats": repeats, "seq_length": seq}
            for name, v in out.items()}


def _cpu_copy(model: torch.nn.Module, build) -> torch.nn.Module:
    m = build()
    m.load_state_dict({k: v.detach().float().cpu() for k, v in model.state_dict().items()})
    return m.eval()


def build_report(cfg, runner, teacher, plan, teacher_eval: dict, best: dict, direct: dict | None,
                 student_dir: Path, direct_dir: Path | None, label_info: dict, labelled_rows: int,
                 device: torch.device) -> dict:
    from bertdist.finetune.heads import task_model

    metric = runner.main_metric
    t_score = teacher_eval["score"]

    def side(result):
        return {"score": result["score"], "metrics": result["metrics"],
                "retention": result["score"] / t_score if t_score else None,
                "epoch": result["epoch"], "steps": result["steps"], "train_rows": result["train_rows"],
                "train_seconds": round(result["train_seconds"], 1), "history": result["history"]}

    from bertdist.export.encoders import family_of

    family = family_of(teacher.config)
    tcfg, head = family.with_kernels(teacher.config, "reference"), family.head_options_of(teacher.hf_config)
    t_cpu = _cpu_copy(teacher.model, lambda: task_model(tcfg, runner.kind, runner.num_labels, device_type="cpu",
                                                        **head))
    s_cpu = plan.build(runner.kind, runner.num_labels, "cpu", kernels="reference")
    s_cpu.load_state_dict(best["_state"])
    s_cpu.eval()
    speed = {"cpu": time_models({"teacher": t_cpu, "student": s_cpu}, teacher.config.vocab_size,
                                cfg.bench_seq_length, torch.device("cpu"), cfg.bench_repeats),
             "cpu_threads": torch.get_num_threads()}
    if device.type == "cuda":
        s_gpu = plan.build(runner.kind, runner.num_labels, "cuda").to(device)
        s_gpu.load_state_dict(best["_state"])
        t_gpu = teacher.model
        with torch.autocast("cuda", dtype=teacher.dtype):
            speed["gpu"] = time_models({"teacher": t_gpu, "student": s_gpu}, teacher.config.vocab_size,
                                       cfg.bench_seq_length, device, cfg.bench_repeats)
    cpu = speed["cpu"]
    speed["cpu_speedup_b32"] = round(cpu["student"]["throughput_b32_seq_per_s"] / cpu["teacher"]["throughput_b32_seq_per_s"], 2)
    speed["cpu_latency_ratio_b1"] = round(cpu["teacher"]["latency_b1_ms"] / cpu["student"]["latency_b1_ms"], 2)
    report = {
        "task": cfg.task, "main_metric": metric, "teacher_path": str(teacher.path),
        "student_spec": plan.describe(),
        "temperature": cfg.temperature, "alpha": cfg.alpha,
        "hidden_weight": cfg.hidden_weight, "attention_weight": cfg.attention_weight,
        "labelled_rows": labelled_rows, "pseudo_labels": label_info,
        "teacher": {"score": t_score, "metrics": teacher_eval["metrics"], "parameters": count_parameters(t_cpu),
                    "size_bytes": dir_size_bytes(teacher.path)},
        "student": {**side(best), "parameters": count_parameters(s_cpu), "size_bytes": dir_size_bytes(student_dir),
                    "model_dir": str(student_dir)},
        "speed": speed,
    }
    if direct is not None:
        report["direct"] = {**side(direct), "model_dir": str(direct_dir)}
        report["student"]["gain_over_direct"] = best["score"] - direct["score"]
        # accuracy-like metrics are fractions; NER and SQuAD F1 are already in points
        points = 1.0 if runner.kind in ("token", "span") else 100.0
        report["student"]["gain_over_direct_points"] = round((best["score"] - direct["score"]) * points, 2)
    return report


def format_report(r: dict) -> str:
    m = r["main_metric"]
    cpu = r["speed"]["cpu"]
    lines = [f"# Distillation report: {r['task']}", "",
             f"teacher {r['teacher_path']}; student {r['student_spec']['spec']} "
             f"({r['student_spec']['layers']} layers, hidden {r['student_spec']['hidden_size']}); "
             f"T={r['temperature']}, alpha={r['alpha']}; {r['labelled_rows']} labelled rows, "
             f"{r['pseudo_labels']['rows']} pseudo-labelled rows", "",
             f"| model | dev {m} | retention | parameters | size MB | CPU latency b1 ms | CPU seq/s b32 |",
             "|---|---|---|---|---|---|---|"]
    t, s = r["teacher"], r["student"]
    mb = lambda b: f"{b / 1e6:.1f}" if b else "-"  # noqa: E731
    lines.append(f"| teacher | {t['score']:.4f} | 1.000 | {t['parameters']:,} | {mb(t['size_bytes'])} | "
                 f"{cpu['teacher']['latency_b1_ms']} | {cpu['teacher']['throughput_b32_seq_per_s']} |")
    lines.append(f"| distilled student | {s['score']:.4f} | {s['retention']:.3f} | {s['parameters']:,} | "
                 f"{mb(s['size_bytes'])} | {cpu['student']['latency_b1_ms']} | {cpu['student']['throughput_b32_seq_per_s']} |")
    if "direct" in r:
        d = r["direct"]
        lines.append(f"| directly fine-tuned student | {d['score']:.4f} | {d['retention']:.3f} | {s['parameters']:,} | "
                     f"{mb(s['size_bytes'])} | (same as student) | (same as student) |")
        lines += ["", f"distilled - direct: {s['gain_over_direct_points']:+.2f} points"]
    lines += ["", f"CPU speed-up at batch 32: {r['speed']['cpu_speedup_b32']}x; at batch 1: "
              f"{r['speed']['cpu_latency_ratio_b1']}x (seq {cpu['teacher']['seq_length']}, "
              f"{r['speed']['cpu_threads']} threads, median of {cpu['teacher']['repeats']}, interleaved)"]
    if "gpu" in r["speed"]:
        g = r["speed"]["gpu"]
        lines.append(f"GPU: teacher {g['teacher']['throughput_b32_seq_per_s']} seq/s, student "
                     f"{g['student']['throughput_b32_seq_per_s']} seq/s at batch 32")
    return "\n".join(lines) + "\n"


def write_report(out: Path, report: dict) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "report.md").write_text(format_report(report))
