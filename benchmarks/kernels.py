"""Times the fused kernels against torch at BERT shapes.

GPU (CUDA device and fused CUDA kernels present): base and large widths at batch x seq =
64 x 128 and 16 x 512 with realistic padding (lengths uniform in [seq/2, seq]); layer norm
and bias+dropout+residual+LN against torch eager and F.layer_norm (time, GB/s, ratio), with
the device-to-device copy bandwidth of the same run as the roofline; padded attention forward
and forward+backward, with attention dropout 0.1 (training) and without, against torch eager,
each scaled_dot_product_attention backend (flash, memory-efficient, cuDNN, math; boolean
key-padding mask) and ``varlen_attn`` on the packed real tokens (no dropout only); unpadded
attention (packed tokens + cu_seqlens) of ours against ``varlen_attn`` and SDPA on the
re-padded sequences (time, TFLOP/s over the real tokens, ratio to the fastest torch option).
Without fused CUDA kernels the torch rows are still measured.

CPU (or --device cpu): the C++ CPU kernels against torch's CPU ops at smaller shapes.

    python benchmarks/kernels.py [--device cpu|cuda] [--json out.json] [--quick]
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

from bertdist.ops import fused, torch_native
from bertdist.ops.reference import reference_attention_math


def _timer(device: str, reps: int, warmup: int):
    def run(fn) -> float:
        """Median seconds per call."""
        for _ in range(warmup):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
            times = []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            return statistics.median(times)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return run


def _lengths(b: int, s: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(s // 2, s + 1, (b,), generator=gen)


def bench_layer_norm(dev, dtype, rows, hidden, timer, rows_out, label):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=g).to(dev, dtype)
    res = torch.randn(rows, hidden, generator=g).to(dev, dtype)
    bias = torch.randn(hidden, generator=g).to(dev, dtype)
    w = torch.ones(hidden, device=dev, dtype=dtype)
    b = torch.zeros(hidden, device=dev, dtype=dtype)
    es = x.element_size()
    ln_bytes = 2 * rows * hidden * es  # read x, write y
    results = {}
    results["fused layer_norm fwd"] = timer(lambda: fused.layer_norm(x, w, b, 1e-12))
    results["F.layer_norm fwd"] = timer(lambda: F.layer_norm(x, (hidden,), w, b, 1e-12))
    for name, t in results.items():
        rows_out.append(dict(kernel=f"LN fwd {label}", impl=name, ms=t * 1e3, gbps=ln_bytes / t / 1e9))
    # bias + dropout + residual + LN, forward+backward, training (p = 0.1).
    xs = [t.detach().requires_grad_(True) for t in (x, bias, res, w, b)]
    gy = torch.randn_like(x)

    def fused_fb():
        y = fused.bias_dropout_add_layer_norm(*xs, p=0.1, training=True, eps=1e-12)
        torch.autograd.grad(y, xs, gy)

    def eager_fb():
        y = F.layer_norm(xs[2] + F.dropout(xs[0] + xs[1], 0.1, True), (hidden,), xs[3], xs[4], 1e-12)
        torch.autograd.grad(y, xs, gy)

    tf, te = timer(fused_fb), timer(eager_fb)
    for name, t in (("fused", tf), ("torch eager", te)):
        rows_out.append(dict(kernel=f"bias+dropout+add+LN fwd+bwd {label}", impl=name, ms=t * 1e3,
                             ratio_vs_torch=te / t))
    rows_out.append(dict(kernel=f"LN fwd {label}", impl="ratio fused/F.layer_norm speed",
                         ratio_vs_torch=results["F.layer_norm fwd"] / results["fused layer_norm fwd"]))


SDPA_BACKENDS = {
    "sdpa flash": "FLASH_ATTENTION",
    "sdpa mem-efficient": "EFFICIENT_ATTENTION",
    "sdpa cuDNN": "CUDNN_ATTENTION",
    "sdpa math": "MATH",
}


def _time_impls(impls: dict, inputs, go, timer, rows_out, label, flops_fwd):
    """Forward and forward+backward of each implementation; an implementation that cannot run
    the call (a backend without mask support, varlen_attn with dropout) gets an "n/a" row."""
    flops_fb = 3.5 * flops_fwd  # backward = 2.5 x forward (five GEMMs vs two)
    times = {}
    for name, fn in impls.items():
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported as not applicable, with the reason
            rows_out.append(dict(kernel=f"{label}", impl=name, note=f"n/a: {str(e).strip().splitlines()[0][:90]}"))
            continue

        def fb(fn=fn):
            torch.autograd.grad(fn(), inputs, go)

        times[name] = (timer(fn), timer(fb))
    torch_times = [t for n, t in times.items() if not n.startswith("fused")]
    if not torch_times:
        return
    best_f, best_fb = min(t[0] for t in torch_times), min(t[1] for t in torch_times)
    for name, (tf, tfb) in times.items():
        rows_out.append(dict(kernel=f"{label} fwd", impl=name, ms=tf * 1e3, tflops=flops_fwd / tf / 1e12,
                             ratio_vs_torch=best_f / tf))
        rows_out.append(dict(kernel=f"{label} fwd+bwd", impl=name, ms=tfb * 1e3,
                             tflops=flops_fb / tfb / 1e12, ratio_vs_torch=best_fb / tfb))


def bench_attention(dev, dtype, b, s, h, d, timer, rows_out, label, with_backends, with_fused=True):
    gen = torch.Generator().manual_seed(1)
    lengths = _lengths(b, s, gen)
    mask = (torch.arange(s)[None, :] < lengths[:, None]).to(dev)
    qkv = torch.randn(b, s, 3, h, d, generator=gen).to(dev, dtype).permute(2, 0, 3, 1, 4)
    q, k, v = (t.detach().requires_grad_(True) for t in qkv)
    go = torch.randn(b, h, s, d, generator=gen).to(dev, dtype)
    flops_fwd = 4 * b * h * s * s * d
    for p in (0.1, 0.0):
        kw = dict(dropout_p=p, training=p > 0)
        impls = {}
        if with_fused:
            impls["fused"] = lambda kw=kw: fused.attention(q, k, v, mask, **kw)
        impls["torch eager"] = lambda kw=kw: reference_attention_math(q, k, v, mask, **kw)
        if with_backends:
            for name, backend in SDPA_BACKENDS.items():
                impls[name] = lambda kw=kw, f=torch_native.sdpa_with(backend): f(q, k, v, mask, **kw)
            impls["varlen_attn (packed)"] = lambda kw=kw: torch_native.attention_via_varlen(q, k, v, mask, **kw)
        else:
            impls["F.scaled_dot_product_attention"] = lambda kw=kw: torch_native.sdpa_attention(q, k, v, mask, **kw)
        _time_impls(impls, (q, k, v), go, timer, rows_out, f"attention p={p:g} {label}", flops_fwd)


def bench_varlen(dev, dtype, b, s, h, d, timer, rows_out, label, with_fused=True):
    """Unpadded attention on the packed real tokens (the model's ``unpad`` path)."""
    gen = torch.Generator().manual_seed(2)
    lengths = _lengths(b, s, gen)
    total = int(lengths.sum())
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(dev, torch.int32)
    qkv = torch.randn(total, 3, h, d, generator=gen).to(dev, dtype)
    q, k, v = (t.detach().requires_grad_(True) for t in qkv.unbind(1))
    go = torch.randn(total, h, d, generator=gen).to(dev, dtype)
    flops_fwd = 4 * h * d * int((lengths.double() ** 2).sum())  # real tokens only
    for p in (0.1, 0.0):
        kw = dict(dropout_p=p, training=p > 0)
        impls = {}
        if with_fused:
            impls["fused varlen"] = lambda kw=kw: fused.varlen_attention(q, k, v, cu, s, **kw)
        impls["varlen_attn"] = lambda kw=kw: torch_native.varlen_attention_flash(q, k, v, cu, s, **kw)
        impls["sdpa on re-padded"] = lambda kw=kw: torch_native.varlen_attention_sdpa(q, k, v, cu, s, **kw)
        _time_impls(impls, (q, k, v), go, timer, rows_out, f"varlen attention p={p:g} {label}", flops_fwd)


def copy_bandwidth(dev, timer, nbytes=1 << 30):
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src))
    return 2 * nbytes / t / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="also write the rows as JSON here")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and shapes")
    args = ap.parse_args(argv)
    dev = args.device
    ok, why = fused.availability("attention", dev)
    if not ok and dev != "cuda":
        print(f"fused kernels not usable on {dev}: {why}", file=sys.stderr)
        return 2
    if not ok:
        print(f"fused kernels not usable on {dev} ({why}): timing torch's kernels only", file=sys.stderr)
    rows: list[dict] = []
    header = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, *sys.argv]),
        "device": torch.cuda.get_device_name() if dev == "cuda" else f"{platform.processor() or platform.machine()} "
        f"({torch.get_num_threads()} torch threads)",
        "torch": torch.__version__,
        "fused": why,
    }
    if dev == "cuda":
        timer = _timer(dev, reps=10 if args.quick else 50, warmup=5)
        header["copy_GBps"] = copy_bandwidth(dev, timer)
        shapes = [("base", 768, 12), ("large", 1024, 16)]
        bs = [(64, 128), (16, 512)]
        for name, hidden, heads in shapes[:1] if args.quick else shapes:
            for b, s in bs:
                for dtype in (torch.bfloat16, torch.float16, torch.float32):
                    lbl = f"{name} {b}x{s} {str(dtype).replace('torch.', '')}"
                    if ok:
                        bench_layer_norm(dev, dtype, b * s, hidden, timer, rows, lbl)
                for dtype in (torch.bfloat16,) if args.quick else (torch.bfloat16, torch.float16):
                    lbl = f"{name} {b}x{s} {str(dtype).replace('torch.', '')}"
                    bench_attention(dev, dtype, b, s, heads, hidden // heads, timer, rows, lbl, True, ok)
                    bench_varlen(dev, dtype, b, s, heads, hidden // heads, timer, rows, lbl, ok)
    else:
        timer = _timer(dev, reps=5 if args.quick else 20, warmup=2)
        for b, s in ((4, 64),) if args.quick else ((8, 128), (2, 512)):
            lbl = f"base {b}x{s} float32"
            bench_layer_norm(dev, torch.float32, b * s, 768, timer, rows, lbl)
            bench_attention(dev, torch.float32, b, s, 12, 64, timer, rows, lbl, False)
            bench_varlen(dev, torch.float32, b, s, 12, 64, timer, rows, lbl)
    print(json.dumps(header, indent=1))
    print(f"{'kernel':<48} {'impl':<32} {'ms':>9} {'GB/s':>8} {'TFLOP/s':>8} {'x torch':>8}  note")
    for r in rows:
        fmt = lambda k, f: (f.format(r[k]) if k in r else "")  # noqa: E731
        print(f"{r['kernel']:<48} {r['impl']:<32} {fmt('ms', '{:.3f}'):>9} {fmt('gbps', '{:.1f}'):>8} "
              f"{fmt('tflops', '{:.2f}'):>8} {fmt('ratio_vs_torch', '{:.2f}'):>8}  {r.get('note', '')}")
    if dev == "cuda":
        print(f"device-to-device copy bandwidth: {header['copy_GBps']:.1f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)
    return 0


def run(argv=None) -> dict:
    """``main`` for callers (the acceptance harness): the header and rows, via a temporary JSON."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/kernels.json"
        rc = main([*(argv or []), "--json", path])
        if rc != 0:
            raise RuntimeError(f"benchmarks/kernels.py exited {rc}")
        with open(path) as f:
            return json.load(f)


if __name__ == "__main__":
    raise SystemExit(main())
