"""``bertdist pretrain RECIPE --plan``: what a run would do, decided for a world size and a device
profile, without starting it (no process group, no GPU, no data read).

``launch_plan`` returns a JSON-able dict: the resolved config, the batch arithmetic, the DeepSpeed
JSON, the optimizer and why, the precision of each tensor class, whether the model is compiled and
captured in CUDA graphs and why, the kernel cases that
``kernels: auto`` will decide with their candidates, the FLOPs per sequence and the memory estimate
(``memory.py``), both the model family's (bertdist/model/families.py).
``format_launch_plan`` prints it for a person.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import math

from bertdist.config import to_dict
from bertdist.model.families import family_of
from bertdist.train.config import TrainConfig, check_batch_sizes
from bertdist.train.memory import GIB
from bertdist.train.precision import autocast_dtype, precision_policy


def _vocab_size(cfg: TrainConfig) -> tuple[int, str]:
    """The vocab size the run would use (the vocab file's), or the config's when the file is absent."""
    path = Path(cfg.data.vocab_file) if cfg.data.vocab_file else None
    if path is not None and path.is_file():
        from bertdist.data.vocab import vocab_file_size

        return vocab_file_size(path), f"from {path}"
    where = f"{path} not found" if path is not None else "data.vocab_file not set"
    return cfg.model.vocab_size, f"model.vocab_size ({where}; the run takes the vocab file's size)"


def optimizer_choice(cfg: TrainConfig, profile) -> dict[str, str]:
    """The optimizer ``build_optimizer`` would construct on ``profile``, and why, predicted
    without building DeepSpeed's op (``bertdist.train.optim.optimizer_choice``)."""
    from bertdist.train.optim import optimizer_choice as choose

    implementation, why = choose(cfg.optimizer, profile)
    return {"implementation": implementation, "why": why}


def _case_rows(cases, profile) -> list[dict[str, Any]]:
    """Each case with its candidates and, for those that cannot run it on ``profile``, why."""
    from bertdist.ops.candidates import WINDOW_OPS, candidates_for

    rows = []
    for case in cases:
        cands = []
        for c in candidates_for(case.op, profile.type):
            try:
                reason = c.unsupported(case, profile)
            except Exception as e:  # noqa: BLE001 - a broken check is reported, not fatal to a plan
                reason = f"support check failed: {type(e).__name__}: {e}"
            cands.append({"name": c.name, "family": c.family, "unsupported": reason})
        shape = case.shape if case.op in WINDOW_OPS else f"b{case.batch} s{case.seq} h{case.hidden} n{case.heads}"
        rows.append({"op": case.op, "dtype": case.dtype, "dropout": case.p if case.dropout else 0.0,
                     "shape": shape, "candidates": cands})
    return rows


def _attention_cases(cfg: TrainConfig, profile) -> dict[str, Any]:
    """ModernBERT's ``attention_backend``: fixed, or the cases ``auto`` gates and times at the start."""
    backend = getattr(cfg.model, "attention_backend", "?")
    if backend != "auto":
        return {"mode": "none", "decides": False, "cases": [],
                "why": f"the {cfg.model_config.__class__.__name__} model runs model.attention_backend {backend}"}
    from bertdist.ops.attention_choice import AttentionWorkload

    workload = AttentionWorkload.for_model(cfg.model_config, batch=cfg.data.micro_batch_size,
                                           seq=cfg.data.max_seq_length, precision=cfg.deepspeed.precision)
    return {"mode": "attention_backend auto", "decides": True,
            "cases": _case_rows(workload.cases(profile.type), profile),
            "why": "rank 0 gates each backend against the reference twin and times those that pass, at the first "
                   "start (then cached); every rank runs the one with the least time summed over the layers"}


def kernel_cases(cfg: TrainConfig, profile) -> dict[str, Any]:
    """The (op, dtype, dropout) cases ``kernels: auto`` decides for this run on ``profile``, each
    with its candidates and, for those that cannot run it there, why (ModernBERT: the cases of
    its ``attention_backend: auto``)."""
    mode = getattr(cfg.model, "kernels", None)
    if mode is None:  # a family without bertdist.ops kernels (ModernBERT: model.attention_backend)
        return _attention_cases(cfg, profile)
    if mode != "auto":
        return {"mode": mode, "decides": False, "why": f"kernels={mode} fixes every op", "cases": []}
    if not profile.is_cuda:
        return {"mode": mode, "decides": False, "cases": [],
                "why": f"auto on {profile.type}: the reference kernels (nothing is measured off CUDA)"}
    from bertdist.ops.kernel_plan import Workload
    from bertdist.train.compile import decide_compile

    workload = Workload.for_model(cfg.model, batch=cfg.data.micro_batch_size, seq=cfg.data.max_seq_length,
                                  precision=cfg.deepspeed.precision,
                                  autocast=autocast_dtype(cfg.deepspeed.precision, cfg.weights) is not None,
                                  compiled=decide_compile(cfg.model.compile, profile.type).enabled)
    budget = cfg.model.kernels_budget_s
    limit = ("no time limit" if budget is None
             else f"at most {budget:g} s (model.kernels_budget_s; cases left run torch's)")
    return {"mode": mode, "decides": True, "budget_s": budget, "why": "measured on rank 0 at the first start "
            f"({limit}; then cached), broadcast to every rank", "cases": _case_rows(workload.cases("cuda"), profile)}


def compile_plan(cfg: TrainConfig, profile) -> dict[str, Any]:
    """Whether the run compiles its model and captures the compiled regions in CUDA graphs on
    ``profile``, each with its reason (ConfigError where ``model.cuda_graphs: true`` cannot run there)."""
    from bertdist.train.compile import decide_compile
    from bertdist.train.cuda_graphs import decide_cuda_graphs

    compiled = decide_compile(cfg.model.compile, profile.type)
    graphs = decide_cuda_graphs(cfg.model.cuda_graphs, profile.type, compiled)
    return {"compile": compiled.enabled, "compile_reason": compiled.reason, "cuda_graphs": graphs.enabled,
            "cuda_graphs_reason": graphs.reason}


def _records_packing(manifest_path: str) -> dict[str, Any]:
    """The packing counts of the run's training records, from their manifest (or why there are none)."""
    if not manifest_path:
        return {"known": False, "why": "data.train_manifest not set"}
    p = Path(manifest_path)
    p = p / "manifest.json" if p.is_dir() else p
    if not p.is_file():
        return {"known": False, "why": f"{p} not found"}
    m = json.loads(p.read_text())
    counts = ((m.get("counts") or {}).get("packing") or {}).get("train")
    if not (m.get("records") or {}).get("packing") or not counts:
        return {"known": True, "packed": False, "manifest": str(p)}
    return {"known": True, "packed": True, "manifest": str(p), **counts}


def modernbert_layout(cfg: TrainConfig, model, predicted: int) -> dict[str, Any]:
    """What a ModernBERT run does beyond its sizes: which layers are global, what a local layer
    sees, the tokens and predictions of a micro-batch and a step, and how its records are packed."""
    layers = range(model.num_hidden_layers)
    seq, micro, batch = cfg.data.max_seq_length, cfg.data.micro_batch_size, cfg.data.global_batch_size
    return {"global_layers": [i for i in layers if model.is_global(i)],
            "local_layers": [i for i in layers if not model.is_global(i)],
            "half_window": model.half_window,
            "tokens": {"row": seq, "micro_batch": micro * seq, "step": batch * seq},
            "predicted": {"mask_prob": cfg.data.mask_prob, "row": predicted, "step": predicted * batch},
            "unpad": model.unpad, "records": _records_packing(cfg.data.train_manifest)}


def launch_plan(cfg: TrainConfig, world_size: int, profile) -> dict[str, Any]:
    """Everything ``format_launch_plan`` prints. Raises ConfigError (with every number) when
    ``world_size`` does not divide the global batch into micro-batches."""
    import dataclasses

    from bertdist.train.ds_config import build_ds_config

    if world_size <= 0:
        from bertdist.config import ConfigError

        raise ConfigError(f"--world-size must be positive, got {world_size}")
    accum = check_batch_sizes(cfg.data, world_size)
    vocab, vocab_note = _vocab_size(cfg)
    cfg = dataclasses.replace(cfg, model=cfg.model.with_vocab(vocab))
    d = cfg.deepspeed
    ds = build_ds_config(cfg, world_size, accum)
    model = cfg.model_config
    family = family_of(model)
    seq, mask_prob = cfg.data.max_seq_length, cfg.data.mask_prob or 0.15
    predicted = cfg.data.max_predictions_per_seq or math.ceil(mask_prob * seq)
    mem = family.estimate_memory(model, micro_batch=cfg.data.micro_batch_size, seq=seq, precision=d.precision,
                                 zero_stage=d.zero_stage, world_size=world_size,
                                 max_predictions=cfg.data.max_predictions_per_seq,
                                 sparse_mlm_head=cfg.model.sparse_mlm_head, mask_prob=mask_prob,
                                 weights_dtype=cfg.weights)
    memory = mem.to_dict()
    memory["device_memory_gib"] = profile.memory_gib or None
    memory["activation_checkpointing"] = d.activation_checkpointing
    memory["formula"] = ("weights + fp32 masters (fp16, bf16 weights) + bf16 autocast copies (bf16 under autocast) + "
                         "gradients (bf16 weights: bf16 + the fp32 sum) + 2 fp32 "
                         "moments, partitioned by ZeRO; activations per layer s*b*h*(16e+2) + a*s^2*b*(2e+1) "
                         "(e = bytes per activation element), x layers, + MLM head logits; checkpointed: layer "
                         "inputs + one layer (bertdist/train/memory.py)")
    forward = family.flops(model, seq, predicted if cfg.model.sparse_mlm_head else None)
    flops = {"seq": seq, "predicted": predicted if cfg.model.sparse_mlm_head else seq, "forward": forward,
             "train_per_sequence": 3 * forward["total"],
             "train_per_step": 3 * forward["total"] * cfg.data.global_batch_size,
             "note": "per sequence of max_seq_length tokens (a full one); training = 3 x forward; "
                     "bertdist/model/flops.py has the formulas"}
    model_row = {"type": family.name, "layers": model.num_hidden_layers, "hidden_size": model.hidden_size,
                 "parameters": mem.parameters, **{k: getattr(model, k) for k in family.plan_fields}}
    if cfg.electra is not None:  # the resolved generator sizes, which the recipe may give as a ratio
        model_row.update(type="electra", embedding_size=model.embedding_width,
                         generator={"layers": model.generator_num_hidden_layers,
                                    "hidden_size": model.generator_hidden_size,
                                    "heads": model.generator_num_attention_heads,
                                    "intermediate_size": model.generator_intermediate_size})
    if family.name == "modernbert":
        model_row["layout"] = modernbert_layout(cfg, model, predicted)
    return {
        "recipe_config": to_dict(cfg),
        "model": model_row,
        "vocab_size": {"value": vocab, "source": vocab_note},
        "device_profile": profile.to_dict(),
        "world_size": world_size,
        "batch": {"global": cfg.data.global_batch_size, "micro": cfg.data.micro_batch_size,
                  "grad_accum": accum, "world_size": world_size},
        "ds_config": ds,
        "optimizer": {"name": cfg.optimizer.name, **optimizer_choice(cfg, profile)},
        "precision": precision_policy(d.precision, profile.type, cfg.weights).to_dict(),
        "compile": compile_plan(cfg, profile),
        "kernels": kernel_cases(cfg, profile),
        "flops": flops,
        "memory": memory,
    }


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _layer_list(layers: list[int]) -> str:
    return ", ".join(map(str, layers)) if len(layers) <= 8 else f"{', '.join(map(str, layers[:4]))}, ..., {layers[-1]}"


def _modernbert_lines(mr: dict[str, Any]) -> list[str]:
    lay = mr["layout"]
    g, loc, t, p, r = lay["global_layers"], lay["local_layers"], lay["tokens"], lay["predicted"], lay["records"]
    lines = [f"  layers: {len(g)} global ({_layer_list(g)}): RoPE θ {mr['global_rope_theta']:,g}, every token sees "
             f"its whole document; {len(loc)} local" + (f" ({_layer_list(loc)})" if loc else "") +
             f": RoPE θ {mr['local_rope_theta']:,g}, a token sees itself and {lay['half_window']} tokens each side "
             f"(local_attention {mr['local_attention']})",
             f"  tokens: rows of {t['row']:,}; {t['micro_batch']:,} a micro-batch, {t['step']:,} a step; MLM at "
             f"{p['mask_prob']:g}: up to {p['row']:,} predicted a row, {p['step']:,} a step"]
    if not r["known"]:
        where = f"records: packing unknown ({r['why']})"
    elif not r["packed"]:
        where = (f"records: {r['manifest']} holds one sequence a row, not packed documents (ModernBERT trains on "
                 "packed rows: build them with pack_documents)")
    else:
        where = (f"records: packed, {r['documents']:,} documents ({r['split_documents']:,} cut across rows) in "
                 f"{r['rows']:,} rows, {r['pieces'] / r['rows']:.1f} a row, {r['fill']:.1%} of the rows' room filled; "
                 "each document attends within itself")
    unpad = ("unpadded: padding never reaches the encoder" if lay["unpad"] else
             "padded: the encoder runs the padding too (model.unpad: false)")
    return lines + [f"  {where}; {unpad}"]


def format_launch_plan(plan: dict[str, Any]) -> str:
    b, p, o, m, k = plan["batch"], plan["precision"], plan["optimizer"], plan["memory"], plan["kernels"]
    prof = plan["device_profile"]
    import yaml

    lines = [f"bertdist pretrain --plan: world size {plan['world_size']} on {prof['name']} ({prof['type']})", "",
             "resolved config:",
             *("  " + ln for ln in yaml.safe_dump(plan["recipe_config"], sort_keys=False).splitlines()),
             f"  (vocab size {plan['vocab_size']['value']}: {plan['vocab_size']['source']})", ""]
    mr = plan["model"]
    if mr["type"] == "electra":
        g = mr["generator"]
        lines += [f"model: ELECTRA: discriminator {mr['layers']} x {mr['hidden_size']}, generator {g['layers']} x "
                  f"{g['hidden_size']} ({g['heads']} heads, FFN {g['intermediate_size']}), shared embeddings of width "
                  f"{mr['embedding_size']}", ""]
    elif mr["type"] == "modernbert":
        lines += [f"model: ModernBERT {mr['layers']} x {mr['hidden_size']}, context {mr['max_position_embeddings']}, "
                  f"local window {mr['local_attention']} (global every {mr['global_attn_every_n_layers']} layers), "
                  f"RoPE θ global {mr['global_rope_theta']:g} / local {mr['local_rope_theta']:g}, attention "
                  f"{mr['attention_backend']}", *_modernbert_lines(mr), ""]
    f = plan["flops"]
    parts = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in f["forward"].items() if k != "total")
    lines += [f"FLOPs per sequence of {f['seq']} tokens ({f['predicted']} predicted): forward "
              f"{f['forward']['total'] / 1e9:.2f} GFLOP ({parts}), training {f['train_per_sequence'] / 1e12:.3f} "
              f"TFLOP; per step {f['train_per_step'] / 1e15:.2f} PFLOP", ""]
    lines += [f"batch: global {b['global']} = micro {b['micro']} x accumulation {b['grad_accum']} x world "
              f"{b['world_size']}", "",
              f"optimizer: {o['name']} -> {o['implementation']} ({o['why']})", "",
              f"precision {p['precision']}: weights {p['weights']}, master weights {p['master_weights']}, compute "
              f"{p['compute']}, gradient accumulation {p['grad_accumulation']}, communication {p['communication']}, "
              f"loss scaling {p['loss_scaling']} ({p['how']})", "",
              f"compile: {plan['compile']['compile_reason']}; {plan['compile']['cuda_graphs_reason']}", "",
              f"kernels: {k['mode']}: {k['why']}"]
    for c in k["cases"]:
        runs = [x["name"] for x in c["candidates"] if not x["unsupported"]]
        cannot = [f"{x['name']} ({x['unsupported']})" for x in c["candidates"] if x["unsupported"]]
        lines.append(f"  {c['op']} {c['dtype']} dropout {c['dropout']:g} {c['shape']}: candidates "
                     f"{', '.join(runs) or 'none'}" + (f"; cannot run: {'; '.join(cannot)}" if cannot else ""))
    dev = f" of {m['device_memory_gib']} GiB" if m["device_memory_gib"] else ""
    lines += ["", f"memory per GPU (estimate{dev}; {m['parameters']:,} parameters):",
              f"  weights {_gib(m['weights'])}, fp32 masters {_gib(m['master_weights'])}, autocast copies "
              f"{_gib(m['autocast_copies'])}, gradients {_gib(m['gradients'])}, optimizer state "
              f"{_gib(m['optimizer_state'])}",
              f"  activations at micro-batch {b['micro']}: {_gib(m['activations'])} without activation "
              f"checkpointing (attention probabilities {_gib(m['attention_probs_per_layer'])} per layer of it), "
              f"{_gib(m['activations_checkpointed'])} with it",
              f"  total: {m['total_gib']} GiB without, {m['total_checkpointed_gib']} GiB with activation "
              f"checkpointing (this recipe: {m['activation_checkpointing']})",
              f"  formula: {m['formula']}",
              "", "DeepSpeed config:", json.dumps(plan["ds_config"], indent=2)]
    return "\n".join(lines)
