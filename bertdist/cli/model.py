"""`bertdist model summary`: parameters per module and FLOPs per sequence for a preset."""
from __future__ import annotations

from collections import OrderedDict


def _fmt(n: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def summary_rows(model) -> "OrderedDict[str, int]":
    """Unique parameters per top-level block (tied weights counted where first seen)."""
    seen: set[int] = set()
    rows: OrderedDict[str, int] = OrderedDict()

    def add(name, module):
        n = 0
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        rows[name] = n

    add("bert.embeddings", model.bert.embeddings)
    for i, layer in enumerate(model.bert.encoder.layer):
        add(f"bert.encoder.layer.{i}", layer)
    add("bert.pooler", model.bert.pooler)
    add("cls.predictions (decoder tied to embeddings)", model.cls.predictions)
    add("cls.seq_relationship", model.cls.seq_relationship)
    return rows


def run(args) -> int:
    import torch

    from bertdist.config import apply_overrides
    from bertdist.model import BertConfig, BertForPreTraining, count_parameters, forward_flops_per_sequence

    data = apply_overrides(BertConfig, {"preset": args.preset}, args.set)
    cfg = BertConfig.from_mapping({**data, "kernels": "reference"})
    with torch.device("meta"):  # sizes only: no memory, no init time
        model = BertForPreTraining(cfg, device_type="cpu")
    rows = summary_rows(model)
    print(f"BERT preset '{cfg.preset}': layers={cfg.num_hidden_layers} hidden={cfg.hidden_size} "
          f"heads={cfg.num_attention_heads} ffn={cfg.intermediate_size} vocab={cfg.vocab_size}")
    width = max(len(k) for k in rows)
    for name, n in rows.items():
        if name.startswith("bert.encoder.layer.") and name not in ("bert.encoder.layer.0",) and not args.all_layers:
            continue
        label = name if name != "bert.encoder.layer.0" or args.all_layers else f"bert.encoder.layer.0 (x{cfg.num_hidden_layers})"
        print(f"  {label:<{width + 6}} {n:>13,}")
    print(f"  {'BertModel (with pooler)':<{width + 6}} {count_parameters(model.bert):>13,}")
    print(f"  {'BertForPreTraining total':<{width + 6}} {count_parameters(model):>13,}")
    pred = args.predicted if args.predicted is not None else None
    f = forward_flops_per_sequence(cfg, args.seq_len, pred)
    print(f"FLOPs per sequence at seq_len={args.seq_len}"
          f" (MLM head over {pred if pred is not None else args.seq_len} positions), multiply-add = 2:")
    for k, v in f.items():
        if k != "total":
            print(f"  {k:<14} {_fmt(v):>10}")
    print(f"  {'forward':<14} {_fmt(f['total']):>10}")
    print(f"  {'train (3x)':<14} {_fmt(3 * f['total']):>10}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("model", help="model inspection")
    msub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    s = msub.add_parser("summary", help="parameters per module and FLOPs per sequence")
    s.add_argument("--preset", default="base", choices=["tiny", "mini", "base", "large"])
    s.add_argument("--seq-len", type=int, default=128)
    s.add_argument("--predicted", type=int, default=None,
                   help="MLM positions projected to the vocab (default: all, a dense head)")
    s.add_argument("--all-layers", action="store_true", help="one row per encoder layer")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model field, e.g. --set vocab_size=50000")
    s.set_defaults(func=run)
