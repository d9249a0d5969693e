"""`bertdist info`: versions, devices, and which kernels are built and active (and why not)."""
from __future__ import annotations

import importlib.metadata
import os
import platform


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def collect() -> dict:
    import torch

    from bertdist.ops import emulated, kernel_status, resolve_kernels

    devices = [f"cpu ({os.cpu_count()} logical cores, {torch.get_num_threads()} torch threads)"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            devices.append(f"cuda:{i} {p.name} (sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB)")
    kernels = {}
    # Always report both: on a machine without a GPU the cuda rows say why CUDA kernels can't run.
    for dt in ("cpu", "cuda"):
        active = resolve_kernels("auto", dt).sources
        kernels[dt] = [
            {"op": s.op, "fused_usable": s.usable, "reason": s.reason, "active_under_auto": active[s.op]}
            for s in kernel_status(dt)
        ]
    from data_pipeline import dedup, instance_native, native_build, wordpiece

    from bertdist.ops.decision_cache import DecisionCache

    required, why = native_build.native_required()
    data_native = {  # the data pipeline's C++ twins (plain pybind11 modules, no torch): which one runs
        "instance_builder": ("native (data_pipeline._native_instances)" if instance_native.available() else
                             f"Python reference ({instance_native.unavailable_reason()})"),
        "wordpiece_encoder": ("native (data_pipeline._native_wordpiece)" if wordpiece.native_available() else
                              f"Python reference ({wordpiece.native_unavailable_reason()})"),
        "dedup_signing": ("native (data_pipeline._native_dedup)" if dedup.native_available() else
                          f"Python reference ({dedup.native_unavailable_reason()})"),
        "native_build": f"{'a failed build is an error' if required else 'optional'}: {why}",
    }
    return {
        "data_pipeline": data_native,
        "versions": {
            "python": platform.python_version(),
            "bertdist": _version("bertdist"),
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda or "none (CPU build)",
            "deepspeed": _version("deepspeed"),
            "apache-beam": _version("apache-beam"),
            "transformers": _version("transformers"),
            "tokenizers": _version("tokenizers"),
        },
        "devices": devices,
        "kernels": kernels,
        "kernel_decisions": cached_decisions(DecisionCache()),
        # kernels: emulated (the CUDA kernels run on the CPU, for tests): built or why not
        "emulated_kernels": emulated.describe(),
    }


def cached_decisions(cache) -> dict:
    """What kernels: auto (and attention_backend: auto) measured and cached, per environment
    (device, torch, build); ``torch_ms``: the baseline's time (the reference twin's for the windowed ops)."""
    from bertdist.ops.candidates import WINDOW_OPS, Case, baseline_name

    envs = []
    for entry in cache.environments().values():
        rows = []
        for d in entry["decisions"].values():
            ms = {m["name"]: m.get("ms") for m in d["measurements"]}
            c = d["case"]
            shape = f"b{c['batch']} s{c['seq']} h{c['hidden']} n{c['heads']}"
            if c["op"] in WINDOW_OPS:  # ModernBERT's attention_backend: auto, per layer kind
                shape += f" {Case(**c).window}{'' if c.get('backward', True) else ' fwd'}"
            rows.append({"op": c["op"], "dtype": c["dtype"], "dropout": c["p"] if c["dropout"] else 0.0,
                         "shape": shape, "choice": d["choice"], "baseline": baseline_name(c["op"]),
                         "choice_ms": ms.get(d["choice"]), "torch_ms": ms.get(baseline_name(c["op"])),
                         "rejected": sorted(m["name"] for m in d["measurements"] if m["status"] in ("failed", "error"))})
        envs.append({"environment": entry["environment"], "updated": entry.get("updated"), "decisions": rows})
    return {"cache": str(cache.path), "environments": envs}


def run(args) -> int:
    info = collect()
    if args.json:
        import json

        print(json.dumps(info, indent=2))
        return 0
    print("versions:")
    for k, v in info["versions"].items():
        print(f"  {k:<13} {v}")
    print("devices:")
    for d in info["devices"]:
        print(f"  {d}")
    print("data pipeline (native module, or the Python reference where it is missing):")
    for k, v in info["data_pipeline"].items():
        print(f"  {k:<18} {v}")
    for dt, rows in info["kernels"].items():
        note = ("kernels: auto measures the candidates on the GPU per run and runs these torch-native ops "
                "unless another passed numerics and was faster" if dt == "cuda" else "kernels: auto runs these")
        print(f"kernels on {dt} ({note}):")
        for r in rows:
            state = "fused usable" if r["fused_usable"] else "fused NOT usable"
            why = f" - {r['reason']}" if r["reason"] else ""
            print(f"  {r['op']:<28} active={r['active_under_auto']:<9} {state}{why}")
    print_decisions(info["kernel_decisions"])
    print(f"emulated CUDA kernels (kernels: emulated, for tests): {info['emulated_kernels']}")
    return 0


def print_decisions(dec: dict) -> None:
    if not dec["environments"]:
        print(f"kernel decisions: none cached yet ({dec['cache']}; kernels: auto writes them on a GPU's first run)")
        return
    print(f"kernel decisions cached in {dec['cache']}:")
    for env in dec["environments"]:
        e = env["environment"]
        print(f"  {e.get('device')} | torch {e.get('torch')} (CUDA {e.get('cuda')}, cuDNN {e.get('cudnn')}) | "
              f"build {e.get('build')} | updated {env['updated']}")
        for r in env["decisions"]:
            times = (f"{r['choice_ms']:.3f} ms vs {r['baseline']} {r['torch_ms']:.3f} ms"
                     if r["choice_ms"] is not None and r["torch_ms"] is not None else "")
            rejected = f"; rejected: {', '.join(r['rejected'])}" if r["rejected"] else ""
            print(f"    {r['op']:<28} {r['dtype']:<9} dropout {r['dropout']:<4g} {r['shape']:<22} -> "
                  f"{r['choice']:<20} {times}{rejected}")


def register(sub) -> None:
    p = sub.add_parser("info", help="versions, devices and kernel status")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
