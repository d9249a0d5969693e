"""`run_pretraining(cfg)`: pretraining with DeepSpeed, from the pipeline's records, of any model
family (bertdist/model/families.py) with any objective (bertdist/train/objective.py).

One phase on every rank: set up the process group, open and verify the records, decide where to
start (``restore.plan_restore``: fresh, ``--resume``, or a new phase from
``checkpoint.init_from``), build the engine (``engine.build_engine``) and the objective, load the plan
(``restore.restore``), then run ``step.train_step`` until ``schedule.total_steps`` (or
``max_steps``), a SIGTERM, or a fault, evaluating, logging and checkpointing on the way.

Per optimizer step each rank runs ``accum`` micro-batches; a single all-reduce after the step
carries the logged metrics, the SIGTERM flag and the non-finite flag, so every rank takes the same
decision at the same step.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

from bertdist.config import ConfigError, save_config
from bertdist.model.families import family_of
from bertdist.train.config import TrainConfig, check_batch_sizes
from bertdist.train.profiling import StepProfiler, describe
from bertdist.train.state import TrainerState, checkpoint_tag
from bertdist.train.step import NonFiniteLossError

__all__ = ["NonFiniteLossError", "TrainResult", "run_pretraining"]


@dataclasses.dataclass
class TrainResult:
    step: int
    stopped_by: str  # "end" | "max_steps" | "sigterm"
    last_checkpoint: str | None
    run_dir: str
    final_eval: dict[str, float] | None


class _Stop:
    """SIGTERM (SLURM's pre-emption notice) -> finish the step, checkpoint, exit 0."""

    def __init__(self):
        self.requested = False
        self._old = None

    def install(self) -> None:
        self._old = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def uninstall(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def _open_data(cfg: TrainConfig):
    """The verified training records; ``cfg`` with the vocab's size; the vocab's continuation mask
    (None for a tokenizer.json without word marks). ``data.vocab_file``: a WordPiece vocab.txt or
    a Hugging Face tokenizer.json, the file the records were built with (sha256 checked)."""
    from bertdist.data import continuation_mask
    from bertdist.data.vocab import vocab_file_size
    from bertdist.train.loader import open_training_records

    if not cfg.data.train_manifest or not cfg.data.vocab_file:
        raise ConfigError("data.train_manifest and data.vocab_file are required")
    records = open_training_records(cfg.data.train_manifest, cfg.data.vocab_file, cfg.data.max_seq_length)
    vocab_file = cfg.data.vocab_file
    size = vocab_file_size(vocab_file)
    if size != int(records.manifest["vocab"]["size"]):
        raise ConfigError(f"{vocab_file} has {size} tokens, the records' vocab {records.manifest['vocab']['size']}")
    cfg = dataclasses.replace(cfg, model=cfg.model.with_vocab(size))
    return records, cfg, continuation_mask(vocab_file)


def _eval_set(cfg: TrainConfig, continuation, rank: int, world: int, device) -> list | None:
    """The held-out batches of this rank (the same count on every rank), or None."""
    from bertdist.train.loader import eval_batches, open_training_records, pin_batches
    from bertdist.train.step import balanced_eval

    if not cfg.data.eval_split:
        return None
    held = open_training_records(cfg.data.train_manifest, cfg.data.vocab_file, cfg.data.max_seq_length,
                                 split=cfg.data.eval_split)
    if not held.num_rows:
        return None
    batches = balanced_eval(eval_batches(held, cfg.data, continuation, rank=rank, world_size=world,
                                         micro_batch_size=cfg.eval.micro_batch_size,
                                         max_sequences=cfg.eval.max_sequences, seed=cfg.eval.seed,
                                         document_attention=family_of(cfg.model_config).attends_within_segments),
                            device)
    # held for the run: pinned once, so every evaluation copies them to the GPU asynchronously
    return pin_batches(batches) if device.type == "cuda" else batches


def _check_device(cfg: TrainConfig, device) -> None:
    import torch

    if cfg.deepspeed.precision == "fp16" and device.type != "cuda":
        raise ConfigError("deepspeed.precision=fp16 needs CUDA (DeepSpeed's CPU accelerator has no fp16); "
                          "use bf16 or fp32 on CPU")
    if cfg.deterministic:
        # Exact on CPU (tested); on CUDA an op without a deterministic kernel warns instead of failing.
        torch.use_deterministic_algorithms(True, warn_only=device.type == "cuda")


def run_pretraining(cfg: TrainConfig, resume: str | None = None, overwrite: bool = False) -> TrainResult:
    """Train one phase. ``resume``: None (fresh), "auto" (latest checkpoint if any) or a checkpoint path.
    ``overwrite``: a fresh run may replace the checkpoints of an earlier run in ``cfg.run_dir``."""
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS handle
    from bertdist.ops import kernels_for_run
    from bertdist.train.checkpoint import CheckpointManager, ensure_universal
    from bertdist.train.compile import apply_compile, decide_compile, load_compile_cache
    from bertdist.train.cuda_graphs import decide_cuda_graphs
    from bertdist.train.distributed import init_distributed
    from bertdist.train.engine import build_engine, save_ds_config
    from bertdist.train.loader import LoaderState, PretrainingLoader
    from bertdist.train.metrics import RunLogger, device_peak_flops
    from bertdist.train.precision import autocast_dtype
    from bertdist.train.restore import check_fresh_start, new_state, plan_restore, restore
    from bertdist.train.objective import build_objective
    from bertdist.train.step import StepRunner

    info = init_distributed(cfg.deepspeed.dist_backend)
    rank, world, device = info.rank, info.world_size, info.device
    grad_accum = check_batch_sizes(cfg.data, world)
    _check_device(cfg, device)
    records, cfg, continuation = _open_data(cfg)
    run_dir = Path(cfg.run_dir)
    check_fresh_start(cfg, resume, overwrite)  # before config.yaml is written over
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    plan = plan_restore(cfg, resume, world)  # before the engine: universal loading is an engine flag
    if plan.mode in ("resume", "init"):  # the same objective sections (resume) or the same model (new phase)
        from bertdist.train.objective import check_checkpoint

        check_checkpoint(cfg, plan.load_dir, plan.tag, plan.mode)
    ckpt = CheckpointManager(cfg.checkpoint_dir, cfg.checkpoint.keep_last_n, rank, world)
    if plan.universal:  # per-rank optimizer shards must be re-partitioned for this world size
        plan = dataclasses.replace(plan, load_dir=ensure_universal(plan.load_dir, plan.tag, rank))
    # kernels: auto on CUDA: rank 0 measures (or reads its cache) for this run's shapes and broadcasts the
    # plan, so every rank runs the same kernels; a copy goes to run_dir. Before seeding: it may use the RNG.
    # The candidates are timed in a layer compiled as the run compiles its own.
    compiled = decide_compile(cfg.model.compile, device.type)
    graphs = decide_cuda_graphs(cfg.model.cuda_graphs, device.type, compiled)  # refuses before the engine
    family = family_of(cfg.model_config)
    kernels = None  # a family without bertdist.ops kernels (ModernBERT) decides its attention below
    if family.uses_kernels:
        kernels = kernels_for_run(cfg.model.kernels, cfg.model, device, micro_batch=cfg.data.micro_batch_size,
                                  seq=cfg.data.max_seq_length, precision=cfg.deepspeed.precision,
                                  autocast=autocast_dtype(cfg.deepspeed.precision, cfg.weights) is not None,
                                  run_dir=str(run_dir), compiled=compiled.enabled,
                                  budget_s=cfg.model.kernels_budget_s)
    attention = family.choose_attention(cfg, device, run_dir)  # ModernBERT's attention_backend: auto, likewise
    built = build_engine(cfg, plan, world, grad_accum, device.type, kernels)
    engine = built.engine
    family.use_attention(engine.module, attention)
    cache_loaded = load_compile_cache(cfg.compile_cache) if compiled.enabled else None
    # in place: checkpoints and export see the same module
    apply_compile(engine.module, compiled, graphs=graphs.enabled)
    if rank == 0:
        save_ds_config(built.ds_config, run_dir)
    # masked LM, general distillation (its frozen teacher outside the engine) or ELECTRA (its sampler)
    objective = build_objective(cfg, engine.module, device, rank)
    state = restore(engine, built.scheduler, plan, cfg, rank, new_state(cfg, world, grad_accum), objective.generators)
    engine.train()

    loader = PretrainingLoader(records, cfg.data, rank=rank, world_size=world, grad_accum=grad_accum,
                               continuation=continuation, pin_device=device,
                               document_attention=family.attends_within_segments)
    eval_set = _eval_set(cfg, continuation, rank, world, device)
    total = cfg.steps_to_run
    log = RunLogger(str(run_dir), rank == 0, cfg.logging.tensorboard, cfg.logging.progress, total, state.step)
    peak, peak_note = device_peak_flops(device, cfg.deepspeed.precision, cfg.logging.device_peak_tflops)
    log.message(f"bertdist pretrain: phase {cfg.phase}, {plan.mode} at step {state.step}/{total}, world {world} "
                f"({info.backend}, {device.type}), global batch {cfg.data.global_batch_size} = micro "
                f"{cfg.data.micro_batch_size} x accum {grad_accum} x world {world}; {records.num_rows} train "
                f"sequences, {loader.steps_per_epoch} steps/epoch ({loader.dropped_per_epoch} left over per epoch); "
                f"MFU peak: {peak_note}; {compiled.reason}; {graphs.reason}")
    log.record("run", state.step, {"mode": plan.mode, "world_size": world, "grad_accum": grad_accum,
                                   "peak_flops": peak, "peak_note": peak_note, "compile": compiled.enabled,
                                   "compile_reason": compiled.reason, "cuda_graphs": graphs.enabled,
                                   "cuda_graphs_reason": graphs.reason,
                                   "steps_per_epoch": loader.steps_per_epoch,
                                   "dropped_per_epoch": loader.dropped_per_epoch, "loader": state.loader},
               tensorboard=False)
    if attention is not None:  # its table and figures went to stderr at the decision; the choice goes here too
        log.record("attention", state.step, {"backend": attention.backend, "summary": attention.summary},
                   tensorboard=False)
    runner = StepRunner.for_run(engine, cfg, device, grad_accum, objective, cuda_graphs=graphs.enabled)
    log.message(objective.describe())
    if objective.without_nsp and loader.has_nsp:
        log.message(f"the records carry NSP labels: {objective.without_nsp}, so they are not used")
    session = _Session(cfg, engine, ckpt, log, eval_set, device, world, state, objective,
                       StepProfiler(cfg.profiling, run_dir, rank, device))
    session.cuda_graphs = graphs.enabled
    if compiled.enabled:
        session.compile_pending = {"cache_loaded": cache_loaded, "cache": cfg.compile_cache, "rank": rank,
                                   "cuda_graphs": graphs.enabled}
    stop = _Stop()
    if cfg.checkpoint.save_on_sigterm:
        stop.install()
    steps = loader.steps(LoaderState.from_dict(state.loader))
    try:
        session.train(runner, steps, stop, total, peak, resumed=plan.mode == "resume")
    finally:
        steps.close()  # stops the loader's prefetch thread
        stop.uninstall()
        log.close()
    last = session.last_checkpoint
    return TrainResult(session.state.step, session.stopped_by, None if last is None else str(ckpt.dir / last),
                       str(run_dir), session.final_eval)


class _Session:
    """The training loop of ``run_pretraining`` and what it updates: the state, the last
    checkpoint, how it stopped, the final evaluation."""

    def __init__(self, cfg: TrainConfig, engine, ckpt, log, eval_set, device, world: int, state: TrainerState,
                 objective, profiler: StepProfiler):
        self.cfg, self.engine, self.ckpt, self.log = cfg, engine, ckpt, log
        self.eval_set, self.device, self.world, self.state = eval_set, device, world, state
        self.objective, self.profiler = objective, profiler
        self.last_checkpoint: str | None = None
        self.consecutive_bad = 0  # steps in a row with a non-finite loss or an fp16 overflow
        self.compile_pending: dict | None = None  # compiled: reported (and its cache saved) after the first step
        self.cuda_graphs = False  # the compiled regions run as CUDA graphs: evaluation marks its batches too
        self.final_eval: dict[str, float] | None = None
        self.stopped_by = "end" if cfg.steps_to_run == cfg.schedule.total_steps else "max_steps"

    def save(self) -> None:
        t = time.time()
        self.state = dataclasses.replace(self.state, skipped_steps=int(self.engine.skipped_steps))
        tag = self.ckpt.save(self.engine, self.state, self.cfg, self.objective.generators)
        self.log.message(f"checkpoint {self.ckpt.dir / tag} saved in {time.time() - t:.1f}s")
        self.log.record("checkpoint", self.state.step, {"tag": tag, "seconds": time.time() - t}, tensorboard=False)
        self.last_checkpoint = tag

    def evaluate(self) -> dict[str, float] | None:
        from bertdist.train.step import evaluate

        if self.eval_set is None:
            return None
        t = time.time()
        res = evaluate(self.engine, self.eval_set, self.device, self.objective,
                       cuda_graphs=self.cuda_graphs)
        res["seconds"] = time.time() - t
        self.log.record("eval", self.state.step, res)
        self.log.message(f"eval @ step {self.state.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in res.items()))
        return res

    def train(self, runner, steps, stop: _Stop, total: int, peak: float, resumed: bool) -> None:
        cfg, log = self.cfg, self.log
        if cfg.eval.at_start and not resumed and self.state.step < total:
            self.evaluate()
        prof = self.profiler
        if cfg.profiling.enabled and self.state.step >= cfg.profiling.start_step:
            log.message(f"profiling: step {cfg.profiling.start_step} has already run (resumed at step "
                        f"{self.state.step}); nothing is profiled")
        try:
            self._loop(runner, steps, stop, total, peak)
        except BaseException:
            prof.abandon()
            raise
        prof.close(self.state.step)  # a window cut short by SIGTERM still writes what it has
        self._finish()

    def _settles_after(self, step: int, total: int) -> bool:
        """Whether the loop reads the device after ``step``: at the end of each logging window, and
        before whatever needs the step's results (an evaluation, a checkpoint, the last step), and
        around the profiled window, which then holds the steps as they run between two logs. fp16
        settles every step: DeepSpeed's loss scaler reads the device anyway."""
        cfg, prof = self.cfg, self.cfg.profiling
        return (step % cfg.logging.every_steps == 0 or step == total or cfg.deepspeed.precision == "fp16"
                or self.compile_pending is not None
                or bool(cfg.eval.every_steps and step % cfg.eval.every_steps == 0)
                or bool(cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0)
                or (prof.enabled and step in (prof.start_step - 1, prof.last_step)))

    def _loop(self, runner, steps, stop: _Stop, total: int, peak: float) -> None:
        """Steps are launched without reading the device; every ``_settles_after`` step the queued
        ones are settled together (one all-reduce, one host sync) and logged, each with the
        window's mean step time."""
        from bertdist.train.step import launch_step, settle

        pending, epochs, t0 = [], [], time.time()
        while self.state.step < total:
            micro_batches, next_loader = next(steps)
            self.profiler.before(self.state.step + 1)
            pending.append(launch_step(runner, micro_batches, stop.requested, self.state.step + 1))
            epochs.append(next_loader.epoch)
            self.state = dataclasses.replace(self.state, step=self.state.step + 1, loader=next_loader.to_dict())
            step = self.state.step
            if not self._settles_after(step, total):
                continue
            results = settle(pending, step - len(pending) + 1, self.cfg.deepspeed.precision)
            seconds = (time.time() - t0) / len(pending)
            for k, res in enumerate(results):
                self._log_step(step - len(results) + 1 + k, res, seconds, epochs[k], total, peak)
            pending, epochs = [], []
            if self.compile_pending is not None:
                self._report_compile(step, seconds)
            if any(res.sums["stop"] > 0 for res in results):
                self.stopped_by = "sigterm"
                self.log.message(f"SIGTERM: stopping after step {step}")
                break
            cfg = self.cfg
            if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < total:
                self.evaluate()
            if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
                self.save()
            t0 = time.time()

    def _report_compile(self, step: int, first_step_s: float) -> None:
        """After the first compiled step: the compile time as a metric of the run, and the compile
        cache written for the next run (by rank 0; every rank compiled the same graphs)."""
        from bertdist.train.compile import compile_seconds, save_compile_cache

        info, self.compile_pending = self.compile_pending, None
        saved = save_compile_cache(info["cache"]) if info["rank"] == 0 else None
        values = {"compile_s": compile_seconds(), "first_step_s": first_step_s,
                  "cache_loaded": info["cache_loaded"], "cache_saved": saved, "cache": info["cache"]}
        if info["cuda_graphs"]:  # graphs on, yet Inductor may have kept some regions out of them
            from bertdist.train.cuda_graphs import skipped_graphs

            values["cuda_graphs_skipped"] = skipped_graphs()
        self.log.record("compile", step, values, tensorboard=False)
        self.log.message(f"torch.compile: {values['compile_s']:.1f} s compiling, first step {first_step_s:.1f} s"
                         + (f"; cache {info['cache']}: loaded {info['cache_loaded']}, saved {saved}"
                            if info["cache"] else "")
                         + (f"; CUDA graphs: {values['cuda_graphs_skipped']} graphs Inductor did not capture "
                            "(TORCH_LOGS=cudagraphs says why)" if info["cuda_graphs"] else ""))

    def _log_step(self, step: int, res, seconds: float, epoch: int, total: int, peak: float) -> None:
        """metrics.jsonl's row of one settled step (TensorBoard and progress at logging steps), and
        the check on consecutive bad steps."""
        from bertdist.train.step import step_metrics

        cfg, log, prof = self.cfg, self.log, self.profiler
        fp16 = cfg.deepspeed.precision == "fp16"
        scale = float(self.engine.optimizer.cur_scale) if fp16 and hasattr(self.engine.optimizer, "cur_scale") \
            else 1.0
        m = step_metrics(res, seconds, self.world, peak, scale, int(self.engine.skipped_steps), epoch)
        if prof.active(step):
            m["profiled"] = True  # slower under the profiler: left out of throughput figures
            summary = prof.after(step)
            if summary is not None:
                log.message(describe(summary) + f" ({prof.dir})")
                log.record("profile", step, summary, tensorboard=False)
        log_now = step % cfg.logging.every_steps == 0 or step == total
        log.record("train", step, m, tensorboard=log_now)
        if log_now:
            log.progress(step, {"loss": m["loss"], "lr": res.lr, "seq/s": round(m["seq_per_s"], 1)})
        self.consecutive_bad = self.consecutive_bad + 1 if res.sums["nonfinite"] > 0 or res.skipped > 0 else 0
        if self.consecutive_bad >= cfg.max_consecutive_nonfinite:
            raise NonFiniteLossError(
                f"{self.consecutive_bad} consecutive steps with non-finite loss or gradient overflow (fp16 loss "
                f"scale now {scale}) at step {step}. Try bf16 instead of fp16, a lower optimizer.lr or a "
                f"longer warmup, a lower deepspeed.initial_scale_power (min_loss_scale is an integer >= 1, "
                f"now {cfg.deepspeed.min_loss_scale}), and check the "
                f"records; restart from the last good checkpoint with --resume auto")

    def _finish(self) -> None:
        saved_now = self.last_checkpoint == checkpoint_tag(self.state.step)
        if self.stopped_by == "sigterm":
            if not saved_now:
                self.save()
            return
        if self.cfg.eval.at_end:
            self.final_eval = self.evaluate()
        if self.cfg.checkpoint.save_at_end and not saved_now:
            self.save()

