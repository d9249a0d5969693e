"""Training-step time of our ModernBertForMaskedLM against transformers', same weights, same packed
batches, side by side in one process (CPU).

    python benchmarks/modernbert_cpu.py                                # tiny and base, 2,048-token batches
    python benchmarks/modernbert_cpu.py --presets base --iters 5 --threads 2
    python benchmarks/modernbert_cpu.py --presets tiny --iters 16 --arms ours hf-packed-sparse

Batches: sequences of mixed lengths (uniform in [--min-len, --max-len]) packed greedily into
batches of at most --tokens tokens, 30% of the tokens masked (labels), as ModernBERT pretrains.
One step = forward, MLM loss, backward. The arms, all on the same batches:

- ours: the packed batch (``cu_seqlens``), attention within each sequence, sparse MLM head
  (masked positions only), ``attention_backend`` sdpa;
- ours-dense: the same with every position projected to the vocabulary (like HF's default head);
- hf-packed: transformers' model (SDPA) on the packed row [1, T], positions restarting in each
  sequence and a block-diagonal (and, for local layers, windowed) mask per layer type, dense head;
- hf-packed-sparse: the same with ``sparse_prediction=True`` (masked positions only);
- hf-padded: transformers' model on the sequences padded to the longest, with the 2-D padding
  mask: what ``ModernBertForMaskedLM`` does on CPU, where it has no unpadded path.

transformers' inputs (masks, positions, padded tensors) are built before timing; ours builds its
packing and masks inside the timed step, so the comparison does not favour ours.

The arms take turns step by step (the order rotates), so a slow spell of the shared machine
hits them alike; each reports the median step time; ratios are arm / ours medians. Every step's
loss is compared across arms first: they compute the same thing.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch
import transformers

from bertdist.export.modernbert_hf import hf_config_dict
from bertdist.model.config import IGNORE_INDEX
from bertdist.model.modernbert import ModernBertForMaskedLM
from bertdist.model.modernbert_config import ModernBertConfig
from bertdist.ops.windowed_attention import Packing


def packed_batches(n_batches: int, tokens: int, min_len: int, max_len: int, vocab: int, mask_rate: float,
                   seed: int = 0) -> list[dict]:
    """Greedy packing: sequences are added while they fit the token budget."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        lengths: list[int] = []
        while True:
            n = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
            if sum(lengths) + n > tokens:
                break
            lengths.append(n)
        total = sum(lengths)
        ids = torch.randint(5, vocab, (total,), generator=g)
        pick = torch.rand(total, generator=g) < mask_rate
        labels = torch.where(pick, ids, torch.full_like(ids, IGNORE_INDEX))
        cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
        out.append(dict(ids=ids, labels=labels, lengths=lengths, cu=cu))
    return out


def hf_packed_inputs(b: dict, half_window: int) -> dict:
    """transformers' inputs for a packed row: positions per sequence, one 4-D bool mask per layer type."""
    packing = Packing.from_cu_seqlens(b["cu"], max(b["lengths"]), b["ids"].shape[0])
    same = packing.sequence[:, None] == packing.sequence[None, :]
    near = (packing.position[:, None] - packing.position[None, :]).abs() <= half_window
    return dict(input_ids=b["ids"][None], labels=b["labels"][None], position_ids=packing.position[None],
                attention_mask={"full_attention": same[None, None], "sliding_attention": (same & near)[None, None]})


def hf_padded_inputs(b: dict) -> dict:
    lengths = torch.tensor(b["lengths"])
    seq = int(lengths.max())
    mask = torch.arange(seq)[None, :] < lengths[:, None]
    ids = torch.zeros(len(lengths), seq, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    ids[mask], labels[mask] = b["ids"], b["labels"]
    return dict(input_ids=ids, attention_mask=mask.long(), labels=labels)


ARMS = ("ours", "ours-dense", "hf-packed", "hf-packed-sparse", "hf-padded")


def bench(preset: str, args) -> list[dict]:
    cfg = ModernBertConfig.from_preset(preset, attention_backend="sdpa")
    torch.manual_seed(0)
    ours = ModernBertForMaskedLM(cfg).train()
    dense = ModernBertForMaskedLM(ModernBertConfig.from_preset(preset, sparse_mlm_head=False)).train()
    dense.load_state_dict(ours.state_dict())
    hf_models = {}
    for name, sparse in (("hf", False), ("hf-sparse", True)):
        hf_cfg = transformers.ModernBertConfig.from_dict({**hf_config_dict(cfg), "sparse_prediction": sparse},
                                                         attn_implementation="sdpa")
        hf_models[name] = transformers.ModernBertForMaskedLM(hf_cfg).train()
        hf_models[name].load_state_dict(ours.state_dict())
    batches = packed_batches(args.iters + args.warmup, args.tokens, args.min_len, args.max_len, cfg.vocab_size,
                             args.mask_rate)

    def step(model, **inputs) -> float:
        model.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        loss.backward()
        return loss.item()

    arms = {
        "ours": lambda b: step(ours, input_ids=b["ids"], labels=b["labels"], cu_seqlens=b["cu"],
                               max_seqlen=max(b["lengths"])),
        "ours-dense": lambda b: step(dense, input_ids=b["ids"], labels=b["labels"], cu_seqlens=b["cu"],
                                     max_seqlen=max(b["lengths"])),
        "hf-packed": lambda b: step(hf_models["hf"], **b["hf_packed"]),
        "hf-packed-sparse": lambda b: step(hf_models["hf-sparse"], **b["hf_packed"]),
        "hf-padded": lambda b: step(hf_models["hf"], **b["hf_padded"]),
    }
    for b in batches:  # transformers' inputs are built before the clock starts (ours builds its masks inside)
        b.update(hf_packed=hf_packed_inputs(b, cfg.half_window), hf_padded=hf_padded_inputs(b))
    names = [n for n in arms if n in args.arms]
    times: dict[str, list[float]] = {n: [] for n in names}
    for i, b in enumerate(batches):
        order = names[i % len(names):] + names[:i % len(names)]
        losses = {}
        for n in order:
            t0 = time.perf_counter()
            losses[n] = arms[n](b)
            if i >= args.warmup:
                times[n].append(time.perf_counter() - t0)
        spread = max(losses.values()) - min(losses.values())
        if spread > 1e-4:
            raise SystemExit(f"{preset} batch {i}: the arms' losses differ by {spread:.2e}: {losses}")
        print(f"# {preset} batch {i + 1}/{len(batches)}: loss {losses['ours']:.4f}, arms' spread {spread:.1e}",
              file=sys.stderr, flush=True)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    rows = []
    for n in names:
        rows.append(dict(preset=preset, arm=n, tokens_per_batch=statistics.mean(len(b["ids"]) for b in batches),
                         sequences_per_batch=statistics.mean(len(b["lengths"]) for b in batches),
                         median_ms=round(med[n], 1), min_ms=round(min(times[n]) * 1e3, 1),
                         max_ms=round(max(times[n]) * 1e3, 1), ratio_over_ours=round(med[n] / med["ours"], 3),
                         iters=len(times[n])))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["tiny", "base"])
    p.add_argument("--tokens", type=int, default=2048, help="token budget of a packed batch")
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--mask-rate", type=float, default=0.3)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS,
                   help="the arms to run (ours is always one: the ratios are over it)")
    args = p.parse_args()
    args.arms = sorted(set(args.arms) | {"ours"}, key=ARMS.index)
    torch.set_num_threads(args.threads)
    print(f"# torch {torch.__version__}, transformers {transformers.__version__}, {platform.machine()}, "
          f"{torch.get_num_threads()} threads; {vars(args)}")
    for preset in args.presets:
        for row in bench(preset, args):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
