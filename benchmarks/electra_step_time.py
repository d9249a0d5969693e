"""Training-step time of ELECTRA against an MLM step of the same discriminator, on this machine.

    python benchmarks/electra_step_time.py [--preset mini] [--batch 32] [--seq 128] [--repeats 15]
                                             [--embedding-size N] [--vocab 30522] [--threads 2]
                                             [--sampling gumbel|multinomial]

Not a test: a measurement to report (docs/pretraining.md quotes it). Both models are built from the
same discriminator config (``--preset``): BERT with its MLM and NSP heads, and ELECTRA with a
generator 1/4 as wide (the paper's default) over shared embeddings (``--embedding-size``, default
the hidden size, so only the objective differs). Each step is the forward, the loss, the backward
and an AdamW update on one batch of full-length sequences with 15% of the tokens masked
(``round(seq x 0.15)`` per row; 85% [MASK], 15% kept), the masked positions precomputed as the
loader ships them. The two models alternate step by step after warm-up (A B A B ...), so both see
the same machine load; the script prints the median of each and their ratio.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch


def batch(vocab: int, b: int, s: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000 if vocab > 2000 else 5, vocab, (b, s), generator=g)
    ids[:, 0], ids[:, -1] = 2, 3  # [CLS] ... [SEP]
    labels = torch.full_like(ids, -100)
    k = round(s * 0.15)
    for row in range(b):
        pos = torch.randperm(s - 2, generator=g)[:k] + 1
        labels[row, pos] = ids[row, pos]
        keep = torch.rand(k, generator=g) >= 0.85
        ids[row, pos[~keep]] = 4  # [MASK]
    mask = torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids), "labels": labels,
            "masked_positions": (labels.reshape(-1) != -100).nonzero().squeeze(1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="mini")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--embedding-size", type=int, default=None)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--sampling", choices=["gumbel", "multinomial"], default=None, help="default: the config's")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from bertdist.model import BertConfig, BertForPreTraining
    from bertdist.model.electra import ElectraForPreTraining
    from bertdist.train.config import PretrainElectraConfig
    from bertdist.train.electra_objective import combined_loss

    bert_cfg = BertConfig.from_preset(args.preset, vocab_size=args.vocab, kernels="reference")
    section = PretrainElectraConfig(embedding_size=args.embedding_size)
    if args.sampling:
        section = dataclasses.replace(section, sampling=args.sampling)
    electra_cfg = section.model_config(bert_cfg)
    torch.manual_seed(0)
    models = {"mlm": BertForPreTraining(bert_cfg, device_type="cpu"),
              "electra": ElectraForPreTraining(electra_cfg, device_type="cpu")}
    sampler = models["electra"].sampler
    models["electra"].sampler = dataclasses.replace(sampler, method=section.sampling, temperature=section.temperature,
                                                    generator=torch.Generator().manual_seed(1))
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    data = batch(args.vocab, args.batch, args.seq)
    nsp = torch.zeros(args.batch, dtype=torch.long)

    def step(name: str) -> float:
        t = time.perf_counter()
        model, opt = models[name], opts[name]
        if name == "mlm":
            loss = model(**data, next_sentence_label=nsp).loss
        else:
            loss = combined_loss(section, model(**data)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    for _ in range(args.warmup):
        step("mlm"), step("electra")
    times = {"mlm": [], "electra": []}
    for _ in range(args.repeats):
        for name in ("mlm", "electra"):
            times[name].append(step(name))
    med = {k: statistics.median(v) for k, v in times.items()}
    g = electra_cfg.generator_config()
    print(f"discriminator {args.preset} ({bert_cfg.num_hidden_layers} x {bert_cfg.hidden_size}), generator "
          f"{g.num_hidden_layers} x {g.hidden_size} ({g.num_attention_heads} heads), embeddings "
          f"{electra_cfg.embedding_width}, vocab {args.vocab}, {section.sampling} sampling; batch {args.batch} x seq {args.seq}; "
          f"{torch.get_num_threads()} threads; {args.repeats} interleaved steps each after {args.warmup} warm-up")
    for k in ("mlm", "electra"):
        print(f"  {k:8s} median {med[k] * 1000:8.1f} ms  (min {min(times[k]) * 1000:.1f}, max {max(times[k]) * 1000:.1f})")
    print(f"  ratio electra / mlm: {med['electra'] / med['mlm']:.3f}")


if __name__ == "__main__":
    main()
