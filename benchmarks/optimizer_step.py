"""Milliseconds and device kernels per optimizer step on BERT-large's parameter list: bertdist's
flat-buffer optimizers (global-norm clipping fused in) against the multi-tensor ones they replace.

The parameter list is BERT-large's (398 tensors, 336 M fp32 parameters; ``--preset`` for others),
with random weights and gradients on the device. Each optimizer runs 5 warm-up steps, then
``--steps`` timed ones between CUDA events (wall clock on CPU); the figure is the median. The
kernels of one more step are counted with torch.profiler. Clipping at norm 1.0 everywhere: fused in
the flat ones, ``torch.nn.utils.clip_grad_norm_`` before the others.

    python benchmarks/optimizer_step.py                # on a GPU
    python benchmarks/optimizer_step.py --preset tiny  # the harness on a CPU
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402


def shapes(cfg) -> list[tuple[int, ...]]:
    """The parameter tensors of BertForPreTraining for ``cfg`` (tied decoder counted once)."""
    from bertdist.model import BertForPreTraining

    model = BertForPreTraining(cfg, device_type="cpu", kernels=None)
    return [tuple(p.shape) for p in {id(p): p for p in model.parameters()}.values()]


def params(shape_list, device, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator(device=device).manual_seed(seed)
    out = [torch.nn.Parameter(torch.randn(*s, device=device, generator=g) * 0.02) for s in shape_list]
    for p in out:
        p.grad = torch.randn(p.shape, device=device, generator=g) * 1e-3
    return out


def median_ms(step, device, steps: int, warm: int = 5) -> float:
    for _ in range(warm):
        step()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def kernels_per_step(step, device) -> int | None:
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def candidates(device):
    """(name, make optimizer from params, clip outside it)."""
    from bertdist.train.flat_optim import FlatAdamW, FlatLamb
    from bertdist.train.lamb import Lamb

    out = [("FlatLamb (clipping fused)", lambda p: FlatLamb(p, lr=1e-3, max_grad_norm=1.0), False),
           ("Lamb (torch foreach) + clip_grad_norm_", lambda p: Lamb(p, lr=1e-3), True),
           ("FlatAdamW (clipping fused)", lambda p: FlatAdamW(p, lr=1e-3, max_grad_norm=1.0), False),
           (f"AdamW(fused={device.type == 'cuda'}) + clip_grad_norm_",
            lambda p: torch.optim.AdamW(p, lr=1e-3, fused=device.type == "cuda"), True)]
    if device.type == "cuda":
        try:
            from deepspeed.ops.lamb import FusedLamb

            out.append(("DeepSpeed FusedLamb + clip_grad_norm_", lambda p: FusedLamb(p, lr=1e-3), True))
        except Exception as e:  # noqa: BLE001 - not installed or its op does not build here
            print(f"DeepSpeed FusedLamb not run: {type(e).__name__}: {str(e)[:100]}")
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="large", choices=["tiny", "mini", "base", "large"])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    from bertdist.model import BertConfig

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape_list = shapes(BertConfig.from_preset(args.preset, vocab_size=30522))
    print(f"{args.preset}: {len(shape_list)} tensors, {sum(torch.Size(s).numel() for s in shape_list) / 1e6:.1f} M "
          f"parameters; {device}, torch {torch.__version__}")
    rows = []
    for name, make, clip in candidates(device):
        p = params(shape_list, device)
        opt = make(p)

        def step(p=p, opt=opt, clip=clip):
            if clip:
                torch.nn.utils.clip_grad_norm_(p, 1.0)
            opt.step()

        ms = median_ms(step, device, args.steps)
        k = kernels_per_step(step, device)
        rows.append({"optimizer": name, "ms": ms, "kernels": k, "source": getattr(opt, "kernel_source", None)})
        print(f"{name:45s} {ms:8.2f} ms/step (median of {args.steps})"
              + (f", {k} kernels per step" if k is not None else "")
              + (f", kernels {rows[-1]['source']}" if rows[-1]["source"] else ""), flush=True)
        del opt, p
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
