"""Training throughput of bertdist's BERT vs Hugging Face's, same device, batch and precision.

One training step = forward + backward + AdamW step on a synthetic full-length batch (no
padding; 15% of positions predicted; NSP labels). Reported per model: sequences/s, tokens/s,
achieved TFLOP/s and MFU. Both MFUs use the same FLOP count, BERT's formula with the MLM head
over the predicted positions only (``bertdist.model.flops``; Hugging Face's dense head does
extra work that is not counted as useful). The device peak is stated in the output.

    .venv/bin/python benchmarks/train_throughput.py --preset mini --batch 16 --seq 128        # CPU (CI)
    .venv/bin/python benchmarks/train_throughput.py --preset base --batch 64 --seq 128 --precision bf16
    .venv/bin/python benchmarks/train_throughput.py --preset large --batch 16 --seq 512 --precision bf16 \
        --json benchmarks/results/train_throughput_large_512.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402


def batch(cfg, b: int, s: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, cfg.vocab_size, (b, s), generator=g)
    ids[:, 0] = 2
    labels = torch.full((b, s), -100)
    chosen = torch.rand((b, s), generator=g) < 0.15
    chosen[:, 0] = False
    labels[chosen] = ids[chosen]
    tt = torch.zeros((b, s), dtype=torch.long)
    tt[:, s // 2:] = 1
    out = dict(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=tt, labels=labels,
               next_sentence_label=torch.randint(0, 2, (b,), generator=g))
    return {k: v.to(device) for k, v in out.items()}, int(chosen.sum())


def time_steps(model, data, steps: int, warmup: int, precision: str, device) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    ctx = (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else
           torch.autocast(device.type, dtype=torch.float16) if precision == "fp16" else contextlib.nullcontext())
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    def step():
        with ctx:
            out = model(**data)
        loss = out.loss if hasattr(out, "loss") else out[0]
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mini", choices=["tiny", "mini", "base", "large"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--precision", default=None, choices=["fp32", "bf16", "fp16"],
                    help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 20 on GPU, 5 on CPU)")
    ap.add_argument("--kernels", default="auto", choices=["auto", "reference", "fused"])
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", help="write the results here (e.g. benchmarks/results/...json)")
    args = ap.parse_args()

    from bertdist.model import BertConfig, BertForPreTraining, train_flops_per_sequence
    from bertdist.train.metrics import device_peak_flops

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    steps = args.steps or (20 if device.type == "cuda" else 5)
    warmup = 5 if device.type == "cuda" else 2
    cfg = BertConfig.from_preset(args.preset, kernels=args.kernels, hidden_dropout_prob=0.1,
                                 attention_probs_dropout_prob=0.1)
    peak, peak_note = device_peak_flops(device, precision, args.peak_tflops)
    data, n_pred = batch(cfg, args.batch, args.seq, device)
    flops_per_step = args.batch * train_flops_per_sequence(cfg, args.seq, round(n_pred / args.batch))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"device: {device.type} ({name}), torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"precision {precision}; preset {args.preset}, batch {args.batch}, seq {args.seq}; "
          f"MFU peak: {peak_note}", flush=True)

    results = {"device": name, "device_type": device.type, "precision": precision, "preset": args.preset,
               "batch": args.batch, "seq": args.seq, "steps": steps, "peak_flops": peak, "peak_note": peak_note,
               "flops_per_step": flops_per_step, "models": {}}

    def report(label, dt):
        r = {"step_s": dt, "seq_per_s": args.batch / dt, "tokens_per_s": args.batch * args.seq / dt,
             "tflops": flops_per_step / dt / 1e12, "mfu": flops_per_step / dt / peak}
        results["models"][label] = r
        print(f"  {label:<34} {r['seq_per_s']:>9.1f} seq/s {r['tokens_per_s']:>11.0f} tok/s "
              f"{r['tflops']:>8.3f} TFLOP/s  MFU {100 * r['mfu']:.2f}%", flush=True)

    torch.manual_seed(0)
    ours = BertForPreTraining(cfg, device_type=device.type).to(device).train()
    kern = sorted(set(ours.bert.kernels.sources.values()))
    report(f"bertdist (kernels {'+'.join(kern)}, sparse MLM head)", time_steps(ours, data, steps, warmup, precision, device))
    del ours
    if not args.skip_hf:
        import transformers

        hf_cfg = transformers.BertConfig(**cfg.to_hf_dict(), attn_implementation="sdpa")
        hf = transformers.BertForPreTraining(hf_cfg).to(device).train()
        hf_data = dict(data)
        report(f"HF transformers {transformers.__version__} (sdpa)", time_steps(hf, hf_data, steps, warmup, precision, device))
        m = results["models"]
        a, b = list(m.values())
        results["speedup_vs_hf"] = a["seq_per_s"] / b["seq_per_s"]
        print(f"  bertdist / HF: {results['speedup_vs_hf']:.2f}x", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
