"""Task distillation: the fine-tuning loop with the distillation losses.

``run_distill(cfg)``:

1. loads the teacher (eval mode; bf16 on a GPU) and the task's runner, tokenizer and dev set;
2. makes the pseudo-label set (``pseudolabel.run_labelling``) unless a finished one for the same
   teacher and tokenizer is there, and refuses one made by another;
3. labels the task's own train rows with the teacher in memory (they keep their gold labels);
4. trains the student (``student.plan_student``) on all rows with ``losses`` (KL + alpha x gold,
   optional TinyBERT terms), DeepSpeed data parallel when asked, evaluating on dev after each pass
   and keeping the best (early stopping after ``patience`` passes without a better score);
5. with ``baseline: direct``, trains the same student on the labelled rows alone (gold loss);
6. exports the student as a Hugging Face task directory and writes ``report.json``/``report.md``.

Data loading, prediction, scoring and export are the fine-tuning modules' own.
"""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from bertdist.config import save_config
from bertdist.distill import losses
from bertdist.distill.config import DistillConfig
from bertdist.distill.pseudolabel import (check_label_set, check_sources, check_top_k, effective_top_k, load_label_rows,
                                         num_outputs, read_manifest, run_labelling, top_k_of)
from bertdist.distill.student import StudentPlan, plan_student
from bertdist.distill.teacher import Teacher, load_teacher
from bertdist.export.tokenizer import bert_tokenizer
from bertdist.finetune.errors import DataError
from bertdist.finetune.tasks import canonical_task, dump_json, make_runner
from bertdist.finetune.train import (apply_update, build_optimization, collate, evaluate, param_groups, predict,
                                     seed_everything, total_steps)
from bertdist.model import IGNORE_INDEX
from bertdist.train.distributed import local_device, rank_and_world, start_process_group

INPUT_KEYS = ("input_ids", "token_type_ids", "attention_mask")


# ---------------------------------------------------------------- rows and batches
def normalise_rows(rows: list[dict], kind: str) -> list[dict]:
    """Give every row the same keys (gold labels ``IGNORE_INDEX``/NaN where absent; a loss mask on
    token rows), so that labelled and pseudo-labelled rows share batches."""
    out = []
    for f in rows:
        g = {k: f[k] for k in INPUT_KEYS}
        g["teacher"] = f["teacher"]
        if "teacher_idx" in f:
            g["teacher_idx"] = f["teacher_idx"]
        n = len(f["input_ids"])
        if kind == "classification":
            g["labels"] = int(f.get("labels", IGNORE_INDEX))
        elif kind == "regression":
            g["labels"] = float(f.get("labels", float("nan")))
        elif kind == "token":
            g["labels"] = list(f.get("labels", [IGNORE_INDEX] * n))
            g["loss_mask"] = list(f["loss_mask"]) if "loss_mask" in f else [int(x != IGNORE_INDEX) for x in g["labels"]]
        elif kind == "span":
            g["start_positions"] = int(f.get("start_positions", IGNORE_INDEX))
            g["end_positions"] = int(f.get("end_positions", IGNORE_INDEX))
        out.append(g)
    return out


def distill_collate(features: list[dict]) -> dict[str, torch.Tensor]:
    """The fine-tuning collate for inputs and gold labels; teacher logits (and the token loss mask)
    padded to the batch's width. Top-k rows (``teacher_idx``) give ``teacher`` = values and
    ``teacher_idx`` = indices; span rows shorter than k are padded with -inf values (unused slots)."""
    batch = collate([{k: v for k, v in f.items() if k not in ("teacher", "teacher_idx", "loss_mask")} for f in features])
    width = batch["input_ids"].shape[1]
    t0 = np.asarray(features[0]["teacher"])
    if "teacher_idx" in features[0]:
        batch["teacher"], batch["teacher_idx"] = _collate_top_k(features, width)
    elif t0.ndim == 2:  # per position: [S, C]
        arr = np.zeros((len(features), width, t0.shape[1]), dtype=np.float32)
        for i, f in enumerate(features):
            arr[i, :len(f["teacher"])] = f["teacher"]
        batch["teacher"] = torch.from_numpy(arr)
    else:
        batch["teacher"] = torch.from_numpy(np.stack([np.asarray(f["teacher"], dtype=np.float32).reshape(-1)
                                                      for f in features]))
    if "loss_mask" in features[0]:
        batch["loss_mask"] = torch.tensor([f["loss_mask"] + [0] * (width - len(f["loss_mask"])) for f in features])
    return batch


def _collate_top_k(features: list[dict], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    vals = [np.asarray(f["teacher"], dtype=np.float32) for f in features]
    idx = [np.asarray(f["teacher_idx"], dtype=np.int64) for f in features]
    if vals[0].ndim == 1:  # classification: [k]
        return torch.from_numpy(np.stack(vals)), torch.from_numpy(np.stack(idx))
    k = max(v.shape[-1] for v in vals)
    span = "start_positions" in features[0]  # [2, k'] per row; tokens: [S, k] per row
    rows = 2 if span else width
    out_v = np.full((len(features), rows, k), -np.inf if span else 0.0, dtype=np.float32)
    out_i = np.zeros((len(features), rows, k), dtype=np.int64)
    for j, (v, i) in enumerate(zip(vals, idx)):
        out_v[j, :v.shape[0], :v.shape[1]] = v
        out_i[j, :i.shape[0], :i.shape[1]] = i
    return torch.from_numpy(out_v), torch.from_numpy(out_i)


def distill_loss(kind: str, logits: torch.Tensor, batch: dict, temperature: float, alpha: float) -> torch.Tensor:
    t = batch["teacher"]
    idx = batch.get("teacher_idx")
    if kind == "classification":
        return losses.classification_loss(logits, t, batch["labels"], temperature, alpha, idx)
    if kind == "regression":
        return losses.regression_loss(logits, t.reshape(-1), batch["labels"], alpha)
    if kind == "token":
        return losses.token_loss(logits, t, batch["loss_mask"] * batch["attention_mask"], batch["labels"], temperature,
                                 alpha, idx)
    if kind == "span":
        return losses.span_loss(logits, t, batch["attention_mask"], batch["start_positions"], batch["end_positions"],
                                temperature, alpha, idx)
    raise DataError(f"task head {kind!r} has no distillation loss")


def gold_loss(kind: str, logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """Plain fine-tuning on gold labels (the direct baseline): the distillation loss with alpha 1 and no teacher term."""
    if kind == "regression":
        return losses.regression_loss(logits, batch["labels"].nan_to_num(0.0), None, 0.0)
    if kind == "span":
        return losses._masked_ce(logits[..., 0].float().masked_fill(~batch["attention_mask"].bool(), float("-inf")),
                                 batch["start_positions"]) / 2 + \
            losses._masked_ce(logits[..., 1].float().masked_fill(~batch["attention_mask"].bool(), float("-inf")),
                              batch["end_positions"]) / 2
    return losses._masked_ce(logits, batch["labels"])


# ---------------------------------------------------------------- one training run
def train_student(cfg: DistillConfig, runner, plan: StudentPlan, rows: list[dict], eval_sets, seed: int,
                  mode: str = "distill", teacher: Teacher | None = None) -> dict:
    """Train a fresh student built from ``plan`` on ``rows``; return the best dev result (with its state)."""
    fcfg = cfg.finetune_config()
    if mode == "direct" and cfg.direct_epochs is not None:
        fcfg = dataclasses.replace(fcfg, epochs=cfg.direct_epochs)
    seed_everything(seed)
    device = local_device(fcfg.device)
    model = plan.build(runner.kind, runner.num_labels, device.type, kernels=fcfg.kernels,
                       hidden_dropout_prob=fcfg.hidden_dropout_prob).to(device)
    intermediate = mode == "distill" and (cfg.hidden_weight > 0 or cfg.attention_weight > 0)
    extra: list[torch.nn.Parameter] = []
    if intermediate:
        if teacher is None:
            raise DataError("the TinyBERT intermediate losses need the teacher at training time")
        from bertdist.export.encoders import family_of

        off = [f"{who} ({family_of(c).name})" for who, c in (("teacher", teacher.config), ("student", plan.config))
               if not family_of(c).captures_layers]
        if off:
            raise DataError(f"hidden_weight={cfg.hidden_weight}, attention_weight={cfg.attention_weight}: TinyBERT's "
                            f"intermediate losses read each encoder layer, and the {' and the '.join(off)} exposes "
                            "none; set both to 0 (logit distillation)")
        layer_map = losses.check_layer_map(cfg.layer_map or plan.teacher_layers or losses.default_layer_map(
            plan.config.num_hidden_layers, teacher.config.num_hidden_layers), plan.config.num_hidden_layers,
            teacher.config.num_hidden_layers)
        from bertdist.distill.capture import LayerCapture

        projection = losses.HiddenProjection(plan.config.hidden_size, teacher.config.hidden_size).to(device)
        extra = list(projection.parameters())
        s_cap = LayerCapture(model.backbone, cfg.attention_weight > 0)
        t_cap = LayerCapture(teacher.model.backbone, cfg.attention_weight > 0)
    rank, world = rank_and_world()
    if fcfg.batch_size % world:
        raise DataError(f"batch_size {fcfg.batch_size} is not divisible by the {world} processes")
    micro = fcfg.batch_size // world
    total = total_steps(fcfg, len(rows))
    groups = param_groups(model, fcfg, fcfg.learning_rate)
    if extra:
        groups.append({"params": extra, "lr": fcfg.learning_rate, "weight_decay": 0.0})
    engine, opt, sched = build_optimization(model, fcfg, groups, fcfg.learning_rate, micro, total)
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=f"{mode} {plan.spec} seed={seed}", disable=not fcfg.progress or rank != 0,
               dynamic_ncols=True)
    g = torch.Generator().manual_seed(seed)
    step, epoch, history, best, stale = 0, 0, [], None, 0
    t0 = time.time()
    while step < total:
        order = torch.randperm(len(rows), generator=g).tolist()
        if world > 1:  # equal counts per rank; rank batches together form the single-process batch
            order = order[:len(order) - len(order) % world][rank::world]
        model.train()
        for i in range(0, len(order), micro):
            batch = {k: v.to(device) for k, v in distill_collate([rows[j] for j in order[i:i + micro]]).items()}
            inputs = {k: batch[k] for k in INPUT_KEYS}
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=fcfg.precision == "bf16" and engine is None):
                if intermediate:
                    s_cap.clear()
                    t_cap.clear()
                logits, _ = (engine or model)(inputs)
                if mode == "distill":
                    loss = distill_loss(runner.kind, logits, batch, cfg.temperature, cfg.alpha)
                else:
                    loss = gold_loss(runner.kind, logits, batch)
                if intermediate:
                    with torch.no_grad():
                        teacher.model(inputs)
                    if cfg.hidden_weight > 0:
                        loss = loss + cfg.hidden_weight * losses.hidden_mse(
                            s_cap.states(batch["attention_mask"]), t_cap.states(batch["attention_mask"]), layer_map,
                            batch["attention_mask"], projection)
                    if cfg.attention_weight > 0:
                        mask = batch["attention_mask"]
                        loss = loss + cfg.attention_weight * losses.attention_kl(
                            s_cap.probs(mask), t_cap.probs(mask), layer_map, mask, s_cap.allowed(mask),
                            t_cap.allowed(mask))
            apply_update(engine, opt, sched, loss, [p for grp in groups for p in grp["params"]], fcfg.max_grad_norm)
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.4f}")
            if step >= total:
                break
        epoch += 1
        result = evaluate(model, runner, eval_sets, fcfg, device)
        result.update(epoch=epoch, step=step)
        history.append({k: v for k, v in result.items() if k != "_rows"})
        if best is None or result["score"] > best["score"]:
            best, stale = result, 0
            best["_state"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        else:
            stale += 1
            if cfg.patience is not None and stale >= cfg.patience:
                break
    bar.close()
    if intermediate:
        s_cap.remove()
        t_cap.remove()
    best.update(train_seconds=time.time() - t0, history=history, steps=step, mode=mode, seed=seed,
                train_rows=len(rows))
    return best


# ---------------------------------------------------------------- the run
def prepare(cfg: DistillConfig):
    """Teacher, runner and dev sets for ``cfg`` (the teacher's tokenizer is the data tokenizer)."""
    task = canonical_task(cfg.task)
    fcfg = cfg.finetune_config()
    device = local_device(fcfg.device)
    # The runner needs a tokenizer before the head kind is known; read the teacher's vocab first
    # (or, for a model with its own tokenizer, its tokenizer.json: ModernBERT's).
    from bertdist.export.hf import ExportError
    from bertdist.export.tokenizer import fast_tokenizer, infer_do_lower_case, read_tokenizer_casing

    tdir = Path(cfg.teacher)
    vocab = tdir / "vocab.txt"
    if vocab.is_file():
        lower = read_tokenizer_casing(tdir)
        tok = bert_tokenizer(vocab, infer_do_lower_case(vocab) if lower is None else lower)
    elif (tdir / "tokenizer.json").is_file():
        tok = fast_tokenizer(tdir / "tokenizer.json")
    else:
        from bertdist.distill.teacher import TeacherError

        raise TeacherError(f"{tdir}: no vocab.txt or tokenizer.json: not a task model directory (`bertdist finetune "
                           "... --set save_model=true` writes one)")
    runner = make_runner(task, cfg.data, tok, fcfg)
    try:
        teacher = load_teacher(tdir, task, runner.kind, runner.num_labels, device=device, precision=fcfg.precision,
                               kernels=fcfg.kernels)
    except ExportError as e:
        raise DataError(str(e)) from None
    return task, fcfg, device, runner, teacher


def pseudo_labels(cfg: DistillConfig, task: str, fcfg, runner, teacher: Teacher) -> tuple[list[dict], dict]:
    """The pseudo-label rows: a finished set is reused (after checking its teacher and tokenizer),
    anything else is (re)labelled, resuming where a killed job stopped."""
    labels_dir = Path(cfg.labels_dir or Path(cfg.output_dir) / "pseudo_labels")
    top_k = run_top_k(cfg, runner, fcfg)
    if (labels_dir / "manifest.json").is_file():
        manifest = read_manifest(labels_dir)
        check_label_set(manifest, labels_dir, task, teacher, fcfg)
        check_top_k(manifest, labels_dir, top_k)
        check_sources(manifest, labels_dir, cfg.unlabeled)
        manifest["reused"] = True
    else:
        manifest = run_labelling(task, runner, teacher, fcfg, list(cfg.unlabeled), labels_dir, shard_rows=cfg.shard_rows,
                                 batch_size=cfg.label_batch_size, progress=fcfg.progress, top_k=cfg.top_k)
        manifest["reused"] = False
    rows = load_label_rows(labels_dir, manifest, top_k) if "shards" in manifest else []
    return rows, {"dir": str(labels_dir), "top_k": top_k,
                  **{k: manifest[k] for k in ("rows", "num_shards", "sources", "reused")}}


def run_top_k(cfg: DistillConfig, runner, fcfg) -> int | None:
    """The k this run trains with (None: full logits); see ``pseudolabel.effective_top_k``."""
    return effective_top_k(runner.kind, num_outputs(runner), cfg.top_k, fcfg.max_seq_length)


def run_distill(cfg: DistillConfig) -> dict:
    """Distil, write the student, the report and metrics; return the report dict."""
    fcfg0 = cfg.finetune_config()
    if fcfg0.deepspeed:
        start_process_group(deepspeed=True)
    task, fcfg, device, runner, teacher = prepare(cfg)
    rank, _ = rank_and_world()
    out = Path(cfg.output_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
    plan = plan_student(cfg.student, teacher, runner.kind)
    eval_sets = runner.eval_sets()
    rows, label_info = pseudo_labels(cfg, task, fcfg, runner, teacher)
    labelled = label_train_rows(runner, teacher, fcfg, label_info["top_k"]) if cfg.use_labelled_rows else []
    train_rows = normalise_rows(labelled + rows, runner.kind)
    if not train_rows:
        raise DataError(f"nothing to train on: {cfg.data} has no train rows and no pseudo-labels were made")

    teacher_eval = evaluate(teacher.model, runner, eval_sets, dataclasses.replace(fcfg, precision="fp32"), device)
    best = train_student(cfg, runner, plan, train_rows, eval_sets, cfg.train.seed, "distill", teacher)
    direct = None
    if cfg.baseline == "direct":
        gold = normalise_rows(labelled or label_train_rows(runner, teacher, fcfg), runner.kind)
        direct = train_student(cfg, runner, plan, gold, eval_sets, cfg.train.seed, "direct")
    report = None
    if rank == 0:
        from bertdist.distill.report import build_report, write_report

        student_dir = _export(out / "model", plan, best["_state"], runner, teacher, fcfg)
        direct_dir = _export(out / "direct_model", plan, direct["_state"], runner, teacher, fcfg) if direct else None
        report = build_report(cfg, runner, teacher, plan, teacher_eval, best, direct, student_dir, direct_dir,
                              label_info, len(labelled), device)
        for name, rows_ in best["_rows"].items():
            dump_json(out / "predictions" / f"{name}.json", rows_)
        write_report(out, report)
    return report


def label_train_rows(runner, teacher: Teacher, fcfg, top_k: int | None = None) -> list[dict]:
    """The task's own train rows with the teacher's logits beside their gold labels (its top-k
    values and indices with ``top_k``, as the pseudo-labelled rows they share batches with)."""
    try:
        feats = runner.train_features()
    except DataError:
        return []  # a task directory without train rows: pseudo-labels only
    logits = predict(teacher.model, feats, dataclasses.replace(fcfg, precision="fp32"), teacher.device)
    out = []
    for f, lg in zip(feats, logits):
        g = dict(f)
        g["teacher"] = np.asarray(lg, dtype=np.float32)
        if top_k is not None:
            g["teacher"], g["teacher_idx"] = top_k_of(g["teacher"], runner.kind, top_k)
        if runner.kind == "token":
            g["loss_mask"] = [int(x != IGNORE_INDEX) for x in f["labels"]]
        out.append(g)
    return out


def _export(out_dir: Path, plan: StudentPlan, state: dict, runner, teacher: Teacher, fcfg) -> Path:
    from bertdist.finetune.export_task import write_task_model

    model = plan.build(runner.kind, runner.num_labels, "cpu", kernels="reference")
    model.load_state_dict(state)
    w = SimpleNamespace(config=plan.config, vocab_file=teacher.vocab_file, do_lower_case=teacher.do_lower_case,
                        tokenizer_files=teacher.tokenizer_files)
    return write_task_model(out_dir, model, runner, w, dataclasses.replace(fcfg, vocab_file=None, do_lower_case=None))


def run_pseudo_label(cfg: DistillConfig) -> dict:
    """The labelling job alone (``bertdist pseudo-label``): teacher outputs over ``cfg.unlabeled``."""
    if cfg.train.deepspeed or int(os.environ.get("WORLD_SIZE", 1)) > 1:
        start_process_group()
    task, fcfg, _, runner, teacher = prepare(cfg)
    labels_dir = Path(cfg.labels_dir or Path(cfg.output_dir) / "pseudo_labels")
    return run_labelling(task, runner, teacher, fcfg, list(cfg.unlabeled), labels_dir, shard_rows=cfg.shard_rows,
                         batch_size=cfg.label_batch_size, progress=fcfg.progress, top_k=cfg.top_k)
