"""Forward+backward time of our BertForPreTraining against Hugging Face's, same config, input, threads.

    python benchmarks/model_cpu.py                      # mini and base, batch 8, seq 128, fp32
    python benchmarks/model_cpu.py --presets mini --iters 20 --threads 2

Both models get the same weights (ours loads HF's state dict), the same batch with realistic
padding (lengths drawn uniformly from [seq/2, seq]), the same MLM labels (15% of real tokens)
and NSP labels, and run in training mode with dropout. Each iteration is a forward, the loss and a
backward. Our MLM head is measured both dense (every position projected to the vocabulary, as
HF does: the like-for-like model comparison) and sparse (masked positions only, our training
default). Ratio = ours / HF time: below 1.0 means ours is faster. Our model runs with the
`kernels` setting given (default: auto, i.e. what a user gets).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import transformers

from bertdist.model import IGNORE_INDEX, BertConfig, BertForPreTraining


def make_batch(vocab: int, batch: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    ids = torch.randint(1000, vocab, (batch, seq), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    types = ((torch.arange(seq)[None, :] >= (lengths // 2)[:, None]).long()) * mask
    pick = (torch.rand(batch, seq, generator=g) < 0.15) & mask.bool()
    pick[:, 0] = False
    labels = torch.where(pick, ids, torch.full_like(ids, IGNORE_INDEX))
    nsp = torch.randint(0, 2, (batch,), generator=g)
    return ids, mask, types, labels, nsp


def time_step(fn, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def bench(preset: str, batch: int, seq: int, iters: int, warmup: int, kernels: str, sparse: bool) -> dict:
    cfg = BertConfig.from_preset(preset, kernels=kernels, sparse_mlm_head=sparse)
    torch.manual_seed(0)
    hf = transformers.BertForPreTraining(transformers.BertConfig(**cfg.to_hf_dict(), attn_implementation="sdpa"))
    ours = BertForPreTraining(cfg)
    ours.load_state_dict(hf.state_dict())
    hf.train()
    ours.train()
    ids, mask, types, labels, nsp = make_batch(cfg.vocab_size, batch, seq)

    def step_hf():
        hf.zero_grad(set_to_none=True)
        out = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels, next_sentence_label=nsp)
        out.loss.backward()

    def step_ours():
        ours.zero_grad(set_to_none=True)
        out = ours(ids, mask, types, labels=labels, next_sentence_label=nsp)
        out.loss.backward()

    # Alternate the two models step by step, so drift in machine load hits both sides alike.
    for _ in range(warmup):
        step_hf()
        step_ours()
    t_hf, t_ours = [], []
    for _ in range(iters):
        t_hf += time_step(step_hf, 1, 0)
        t_ours += time_step(step_ours, 1, 0)
    med_hf, med_ours = statistics.median(t_hf), statistics.median(t_ours)
    return {
        "preset": preset,
        "batch": batch,
        "seq": seq,
        "kernels_active": ours.bert.kernels.sources,
        "sparse_mlm_head": sparse,
        "hf_ms": round(med_hf * 1e3, 1),
        "ours_ms": round(med_ours * 1e3, 1),
        "ratio_ours_over_hf": round(med_ours / med_hf, 3),
        "iters_each": len(t_hf),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["mini", "base"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--kernels", default="auto", choices=["auto", "reference", "fused"])
    ap.add_argument("--head", default="both", choices=["sparse", "dense", "both"],
                    help="our MLM head: vocab projection of masked positions only (sparse, the default"
                         " in training) or of every position like HF (dense)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, threads {args.threads}, fp32, training mode")
    heads = {"sparse": [True], "dense": [False], "both": [False, True]}[args.head]
    for preset in args.presets:
        for sparse in heads:
            r = bench(preset, args.batch, args.seq, args.iters, args.warmup, args.kernels, sparse)
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
