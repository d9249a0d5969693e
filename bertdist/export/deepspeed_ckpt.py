"""DeepSpeed checkpoints -> one fp32 state dict, for any ZeRO stage and world size.

Layout (DeepSpeed's ``engine.save_checkpoint(save_dir, tag)``): ``save_dir/latest``
names the newest tag; ``save_dir/<tag>/`` holds ``mp_rank_00_model_states.pt``
(ZeRO-3: ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank) and, with a
ZeRO/bf16 optimizer, one ``*_optim_states.pt`` per data-parallel rank holding
that rank's slice of the fp32 master weights. DeepSpeed's own
``zero_to_fp32`` helpers stitch the slices back together; we only find the
files and take the fp32 masters rather than the (possibly bf16/fp16) module
copy.
"""
from __future__ import annotations

import dataclasses
import glob
import io
import json
import os
import contextlib
from pathlib import Path

import torch

from bertdist.export.hf import ExportError, strip_wrapper_prefix


@dataclasses.dataclass
class CheckpointRef:
    save_dir: Path  # the directory holding `latest` and the tag folders
    tag: str
    path: Path  # save_dir / tag


def _is_tag_dir(p: Path) -> bool:
    return p.is_dir() and bool(glob.glob(str(p / "*model_states.pt")))


def resolve_checkpoint(path: str | os.PathLike, tag: str | None = None) -> CheckpointRef:
    """A run dir, a DeepSpeed save dir (with ``latest``) or one checkpoint (tag) dir -> CheckpointRef."""
    p = Path(path)
    if not p.exists():
        raise ExportError(f"checkpoint path does not exist: {p}")
    if _is_tag_dir(p):
        if tag is not None and tag != p.name:
            raise ExportError(f"{p} is checkpoint {p.name!r}, but tag {tag!r} was asked for")
        return CheckpointRef(p.parent, p.name, p)
    for save_dir in (p, p / "checkpoints", p / "checkpoint", p / "ckpt"):
        if tag is not None and _is_tag_dir(save_dir / tag):
            return CheckpointRef(save_dir, tag, save_dir / tag)
        latest = save_dir / "latest"
        if tag is None and latest.is_file():
            t = latest.read_text().strip()
            if not _is_tag_dir(save_dir / t):
                raise ExportError(f"{latest} names checkpoint {t!r}, but {save_dir / t} holds no model states")
            return CheckpointRef(save_dir, t, save_dir / t)
    tags = sorted(d.name for d in p.iterdir() if _is_tag_dir(d)) if p.is_dir() else []
    hint = f"; checkpoints found: {tags} (pass --tag)" if tags else ""
    raise ExportError(f"{p}: no DeepSpeed checkpoint (no `latest` file or *model_states.pt){hint}")


@dataclasses.dataclass
class ConsolidatedCheckpoint:
    state_dict: dict[str, torch.Tensor]  # our BertForPreTraining keys, fp32
    ref: CheckpointRef
    zero_stage: int
    world_size: int
    master_weights: bool  # True: from the fp32 optimizer masters; False: the module copy


def _load(path: Path) -> dict:
    from bertdist.export.safe_load import load_deepspeed_file

    return load_deepspeed_file(path)


def consolidate(path: str | os.PathLike, tag: str | None = None, quiet: bool = True) -> ConsolidatedCheckpoint:
    """The fp32 weights of a DeepSpeed checkpoint as one state dict with HF/our key names."""
    ref = resolve_checkpoint(path, tag)
    optim_files = sorted(glob.glob(str(ref.path / "*_optim_states.pt")))
    if optim_files:
        from deepspeed.utils import zero_to_fp32

        from bertdist.export.safe_load import safe_torch_load_in

        head = _load(Path(optim_files[0]))["optimizer_state_dict"]
        stage = int(head.get("zero_stage", 0))
        world = head.get("partition_count", len(optim_files))
        world = max(world) if isinstance(world, (list, tuple)) else int(world)
        del head
        # DeepSpeed prints progress to stdout; keep `bertdist export` output readable.
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink) if quiet else contextlib.nullcontext(), safe_torch_load_in(zero_to_fp32):
            sd = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(ref.save_dir), tag=ref.tag)
        master = True
    else:
        # No separate optimizer files: plain data parallel (stage 0) with the weights in the module.
        files = sorted(glob.glob(str(ref.path / "*model_states.pt")))
        state = _load(Path(files[0]))
        if "module" not in state or state["module"] is None:
            raise ExportError(f"{files[0]}: no 'module' weights in the model states")
        sd = state["module"]
        stage, world, master = 0, int(state.get("dp_world_size", 1) or 1), True
        if any(v.is_floating_point() and v.dtype != torch.float32 for v in sd.values()):
            # Mixed precision without ZeRO: the fp32 masters sit in the optimizer wrapper's state.
            masters = _stage0_masters(state)
            if masters is None:
                master = False  # only the fp16/bf16 module copy was saved
            else:
                sd = masters
    sd = strip_wrapper_prefix({k: v for k, v in sd.items() if torch.is_tensor(v)})
    sd = {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in sd.items()}
    sd = {k: v for k, v in sd.items() if not k.endswith("position_ids")}
    if not master:
        import warnings

        warnings.warn(f"{ref.path}: no fp32 master weights saved; exporting the {next(iter(sd.values())).dtype} module copy")
    return ConsolidatedCheckpoint(sd, ref, stage, world, master)


def _stage0_masters(state: dict) -> dict[str, torch.Tensor] | None:
    """Module state with every trainable parameter replaced by its fp32 master, or None.

    DeepSpeed's fp16/bf16 wrapper without ZeRO saves ``optimizer.fp32_groups``: per param
    group, the fp32 masters in the group's order, without names. Each group lists parameters
    in module order (a subsequence of it), and each master rounds exactly to its half-precision
    module copy; we align on that, and give up (None) unless every master finds its parameter.
    """
    opt = state.get("optimizer")
    groups = opt.get("fp32_groups") if isinstance(opt, dict) else None
    if not groups:
        return None
    module = state["module"]
    buffers = set(state.get("buffer_names") or [])
    names, seen = [], {}
    for k, v in module.items():  # unique parameters in module order; tied keys point at the first
        if k in buffers or not v.is_floating_point():
            continue
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key in seen:
            continue
        seen[key] = k
        names.append(k)
    assigned: dict[str, torch.Tensor] = {}
    for group in groups:
        i = 0
        for t in group:
            j = i
            while j < len(names) and not (names[j] not in assigned and tuple(module[names[j]].shape) == tuple(t.shape)
                                          and torch.equal(t.to(module[names[j]].dtype), module[names[j]])):
                j += 1
            if j == len(names):
                return None
            assigned[names[j]] = t.float()
            i = j + 1
    out = {}
    for k, v in module.items():
        if k in assigned:
            out[k] = assigned[k]
        elif v.is_floating_point() and k not in buffers:
            key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
            first = seen.get(key)
            out[k] = assigned.get(first, v.float()) if first is not None else v.float()
        else:
            out[k] = v
    return out


def find_resolved_config(ref: CheckpointRef) -> tuple[dict, Path] | None:
    """The resolved run config saved with the checkpoint (YAML or JSON), nearest first."""
    import yaml

    dirs = [ref.path, ref.save_dir, ref.save_dir.parent]
    names = ("bertdist_config.yaml", "config.yaml", "resolved_config.yaml", "run_config.yaml", "train_config.yaml", "config.yml", "config.json")
    for d in dirs:
        for n in names:
            p = d / n
            if p.is_file():
                data = json.loads(p.read_text()) if p.suffix == ".json" else yaml.safe_load(p.read_text())
                if isinstance(data, dict):
                    return data, p
    return None
