"""Copies and casts per training step by how bf16 is run: ``aten::copy_`` and ``aten::_to_copy``
(every cast is one) counted by torch.profiler over one step, after one warm-up step.

The step is the trainer's arithmetic without DeepSpeed: ``--accum`` micro-batches of
``--batch`` x ``--seq`` random MLM batches (every 7th position predicted), backward, and the flat
LAMB with clipping. Modes:

- ``autocast``: fp32 weights, the forward under ``torch.autocast(bfloat16)`` (``deepspeed.bf16_weights: fp32``);
- ``bf16_weights``: bf16 weights with fp32 masters in the flat optimizer (``bf16_weights: bf16``),
  each micro-batch's gradients folded into the fp32 sum;
- ``fp32``: no mixed precision, for reference.

    python benchmarks/precision_copies.py --preset base --kernels fused           # CPU
    python benchmarks/precision_copies.py --preset large --device cuda            # a GPU
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

MODES = ("fp32", "autocast", "bf16_weights")
COUNTED = ("aten::copy_", "aten::_to_copy")


def count(mode: str, preset: str, kernels: str, device: str, batch: int, seq: int, accum: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from bertdist.model import BertForPreTraining
    from bertdist.model.config import BertConfig
    from bertdist.train.flat_optim import FlatLamb

    torch.manual_seed(0)
    cfg = BertConfig.from_preset(preset, kernels=kernels)
    model = BertForPreTraining(cfg, device_type=device).to(device)
    dtype = torch.bfloat16 if mode == "bf16_weights" else torch.float32
    opt = FlatLamb([{"params": list(model.parameters()), "weight_decay": 0.01}], lr=1e-4, max_grad_norm=1.0,
                   param_dtype=dtype)
    g = torch.Generator().manual_seed(1)

    def micro_batch() -> dict:
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
        labels = torch.full((batch, seq), -100)
        labels[:, ::7] = ids[:, ::7]
        mb = dict(input_ids=ids, attention_mask=torch.ones(batch, seq, dtype=torch.long),
                  token_type_ids=torch.zeros_like(ids), labels=labels,
                  next_sentence_label=torch.zeros(batch, dtype=torch.long))
        return {k: v.to(device) for k, v in mb.items()}

    batches = [[micro_batch() for _ in range(accum)] for _ in range(2)]

    def step(mbs) -> None:
        for i, mb in enumerate(mbs):
            with torch.autocast(device, dtype=torch.bfloat16, enabled=mode == "autocast"):
                out = model(**mb)
            (out.loss / accum).backward()
            if i < accum - 1:
                opt.accumulate_grads()
        opt.step()
        opt.zero_grad()

    step(batches[0])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(batches[1])
    counts = {e.key: e.count for e in prof.key_averages()}
    return {"mode": mode, **{k: counts.get(k, 0) for k in COUNTED}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="base")
    ap.add_argument("--kernels", default="fused", help="the model's kernels (fused, reference, auto, ...)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = ap.parse_args()
    rows = [count(m, args.preset, args.kernels, args.device, args.batch, args.seq, args.accum) for m in args.modes]
    print(json.dumps({"preset": args.preset, "kernels": args.kernels, "device": args.device, "batch": args.batch,
                      "seq": args.seq, "accum": args.accum, "torch": torch.__version__, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
