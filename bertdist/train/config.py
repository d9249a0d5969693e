"""TrainConfig: the schema of `bertdist pretrain` recipes (configs/pretrain/*.yaml).

Each component gets only its own section: the model its ``BertConfig`` (or, with
``model_type: modernbert``, its ``ModernBertConfig``), the loader ``LoaderConfig``, the optimizer
``OptimizerConfig`` and so on. The model section is filled from its family's ``preset`` first
(bertdist/model/families.py), explicit keys win; its ``vocab_size`` always comes from the vocab
file (``data.vocab_file``).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Literal, Optional, Sequence, Union

from bertdist.config import ConfigError, apply_overrides, from_dict, load_yaml
from bertdist.model.config import BertConfig, ElectraConfig, model_config_from_mapping
from bertdist.model.families import family_of, family_of_mapping, section_presets
from bertdist.model.modernbert_config import ModernBertConfig


@dataclasses.dataclass
class LoaderConfig:
    train_manifest: str = ""  # manifest.json of the pipeline's training shards
    eval_split: Optional[str] = "heldout"  # split of the same manifest used for evaluation; None: no eval
    # the vocab.txt or Hugging Face tokenizer.json the shards were built with (sha256 checked)
    vocab_file: str = ""
    max_seq_length: int = 128  # must equal the manifest's
    micro_batch_size: int = 32  # per process, per forward
    global_batch_size: int = 256  # micro x accumulation x world size
    masking: Literal["auto", "static", "dynamic"] = "auto"  # auto: dynamic iff the records are unmasked
    mask_prob: Optional[float] = None  # None: the manifest's masked_lm_prob
    # None: the manifest's; with a mask_prob other than the records', ceil(mask_prob x max_seq_length)
    max_predictions_per_seq: Optional[int] = None
    # dynamic masking: "token", "whole_word" or "span" (SpanBERT; bertdist/data/masking.py has the
    # rules). None: from whole_word_mask (the older setting: true is whole_word, false token), else
    # the manifest's; both set and meaning different modes is an error
    masking_mode: Optional[Literal["token", "whole_word", "span"]] = None
    whole_word_mask: Optional[bool] = None  # None: the manifest's setting
    # dynamic masking: a masked position becomes [MASK] with mask_replace_prob, a random token with
    # random_replace_prob, else stays. None: the manifest's (BERT's 0.8 / 0.1 when it has none)
    mask_replace_prob: Optional[float] = None
    random_replace_prob: Optional[float] = None  # mask_replace_prob + random_replace_prob <= 1
    shuffle_window_shards: int = 8  # rows are shuffled within windows of this many shards
    pad_to_multiple_of: int = 8  # batches are padded to their longest row, rounded up to this
    seed: int = 12345  # data order and masking
    prefetch_steps: int = 2  # steps collated ahead in a background thread (0: inline)

    def __post_init__(self) -> None:
        if self.mask_prob is not None and not 0.0 < self.mask_prob < 1.0:
            raise ConfigError(f"data.mask_prob must be in (0, 1), got {self.mask_prob}")
        from bertdist.data.masking import check_replace_probs, resolve_masking_mode

        try:
            resolve_masking_mode(self.masking_mode, self.whole_word_mask, "data.")
            check_replace_probs(0.8 if self.mask_replace_prob is None else self.mask_replace_prob,
                                0.1 if self.random_replace_prob is None else self.random_replace_prob, "data.")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for name in ("micro_batch_size", "global_batch_size", "max_seq_length", "shuffle_window_shards",
                     "pad_to_multiple_of", "max_predictions_per_seq"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"data.{name} must be positive, got {getattr(self, name)}")


@dataclasses.dataclass
class OptimizerConfig:
    # stable_adamw: AdamW with per-tensor update clipping (bertdist/train/stable_adamw.py), ModernBERT's
    name: Literal["lamb", "adamw", "stable_adamw"] = "lamb"
    lr: float = 6e-3  # peak learning rate (reached at the end of warmup)
    betas: list[float] = dataclasses.field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-6
    weight_decay: float = 0.01
    no_decay: list[str] = dataclasses.field(default_factory=lambda: ["bias", "LayerNorm"])
    # LAMB trust-ratio clamp, as in DeepSpeed's FusedLamb (max_coeff / min_coeff).
    lamb_max_coeff: float = 10.0
    lamb_min_coeff: float = 0.01
    # auto: fused on CUDA where it loads; flat: bertdist's flat-buffer kernels (train/optim.py)
    implementation: Literal["auto", "fused", "torch", "flat"] = "auto"
    # stable_adamw only: weight decay independent of the peak lr (optimi's decouple_lr): each step
    # multiplies the weights by 1 - weight_decay x (lr / peak lr), e.g. ModernBERT's 1e-5
    lr_independent_weight_decay: bool = False

    @property
    def clips_itself(self) -> bool:
        """Whether the optimizer computes the global gradient norm and clips inside its step (flat)."""
        return self.implementation == "flat"

    def __post_init__(self) -> None:
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optimizer.betas must be two numbers in [0, 1), got {self.betas}")
        if self.lr <= 0:
            raise ConfigError(f"optimizer.lr must be positive, got {self.lr}")
        if self.name == "stable_adamw" and self.implementation in ("fused", "flat"):
            raise ConfigError(f"optimizer.name=stable_adamw has no {self.implementation} implementation (its "
                              "per-tensor update clipping is bertdist's PyTorch StableAdamW); use implementation "
                              "auto or torch")
        if self.lr_independent_weight_decay and self.name != "stable_adamw":
            raise ConfigError(f"optimizer.lr_independent_weight_decay is StableAdamW's option; optimizer.name is "
                              f"{self.name!r} (its weight decay scales with lr: set weight_decay = decay per step / "
                              "peak lr instead)")


@dataclasses.dataclass
class ScheduleConfig:
    total_steps: int = 7038  # length of the decay; the run stops here unless max_steps is smaller
    warmup_steps: Optional[int] = None  # either this ...
    warmup_fraction: Optional[float] = 0.2843  # ... or a fraction of total_steps (NVIDIA phase 1)
    # after warmup: linear or poly to min_lr_ratio at total_steps; constant; or wsd, warmup-stable-decay
    # (trapezoidal): the peak lr until the last decay_fraction of total_steps, then down to min_lr_ratio
    decay: Literal["linear", "poly", "constant", "wsd"] = "poly"
    poly_power: float = 0.5
    min_lr_ratio: float = 0.0  # floor of the decay, as a fraction of the peak lr
    # wsd: the decay's length as a fraction of total_steps (0: none in this phase, a later phase decays),
    # and its shape: linear, or 1-sqrt (lr = peak x (1 - sqrt(fraction of the decay done)), ModernBERT's)
    decay_fraction: float = 0.1
    decay_shape: Literal["linear", "1-sqrt"] = "1-sqrt"

    def __post_init__(self) -> None:
        if self.total_steps <= 0:
            raise ConfigError(f"schedule.total_steps must be positive, got {self.total_steps}")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise ConfigError(f"schedule.decay_fraction must be in [0, 1], got {self.decay_fraction}")
        if self.decay == "wsd" and self.resolved_warmup_steps + self.decay_steps > self.total_steps:
            raise ConfigError(
                f"schedule: warmup {self.resolved_warmup_steps} steps + decay {self.decay_steps} steps "
                f"(decay_fraction {self.decay_fraction} x total_steps {self.total_steps}) > total_steps "
                f"{self.total_steps}; shorten the warmup or lower decay_fraction")
        if self.warmup_steps is not None and self.warmup_fraction is not None:
            raise ConfigError("schedule: set warmup_steps or warmup_fraction, not both "
                              f"(got {self.warmup_steps} and {self.warmup_fraction}); set the other to null")

    @property
    def decay_steps(self) -> int:
        """wsd: the steps of the final decay (at least one unless decay_fraction is 0)."""
        return max(1, int(round(self.decay_fraction * self.total_steps))) if self.decay_fraction else 0

    @property
    def resolved_warmup_steps(self) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        return int(round((self.warmup_fraction or 0.0) * self.total_steps))


@dataclasses.dataclass
class DeepSpeedConfig:
    zero_stage: int = 1
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    # bf16 only: the dtype of the model's weights (bertdist/train/precision.py). fp32: fp32 weights,
    # bf16 matmuls under torch.autocast (a cast of every weight per forward). bf16: bf16 weights and
    # activations; fp32 master weights, gradient sums and all-reduce in the flat optimizer (needs
    # optimizer.implementation flat, zero_stage 0). auto: bf16 where it can run, else fp32
    bf16_weights: Literal["auto", "fp32", "bf16"] = "auto"
    gradient_clipping: float = 1.0  # 0 disables
    # fp16 dynamic loss scaling (DeepSpeed's names)
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: int = 1  # the floor of the dynamic scale; DeepSpeed's schema takes an integer >= 1
    activation_checkpointing: Literal["none", "torch", "deepspeed"] = "none"
    ds_config: Optional[str] = None  # user JSON merged into the generated one; conflicts are errors
    dist_backend: Optional[str] = None  # None: nccl on CUDA, gloo on CPU

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"deepspeed.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.min_loss_scale < 1:
            raise ConfigError(f"deepspeed.min_loss_scale must be an integer >= 1 (DeepSpeed's fp16.min_loss_scale), "
                              f"got {self.min_loss_scale}")


@dataclasses.dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # default: <run_dir>/checkpoints
    every_steps: int = 1000  # 0: only at the end / on SIGTERM
    keep_last_n: int = 3  # 0 keeps all
    save_at_end: bool = True
    save_on_sigterm: bool = True
    # Phase 2: start from this phase-1 checkpoint (a checkpoint dir with `latest`, or one tag dir),
    # loading weights and optimizer moments but with a fresh LR schedule and step count.
    init_from: Optional[str] = None
    init_load_optimizer: bool = True


@dataclasses.dataclass
class LoggingConfig:
    every_steps: int = 10  # TensorBoard scalars and progress-bar refresh; JSONL gets every step
    tensorboard: bool = True
    progress: Literal["tqdm", "rich", "none"] = "tqdm"
    device_peak_tflops: Optional[float] = None  # None: from the table in metrics.py


@dataclasses.dataclass
class ProfilingConfig:
    """torch.profiler over a window of training steps, on every rank: host operators and, on CUDA,
    device kernels (bertdist/train/profiling.py). Writes ``run_dir/profile/``: a per-rank summary
    (time per step, device busy time, kernel launches, the top operators) and, optionally, a Chrome
    trace. The profiled steps run slower; their metrics rows say ``profiled``."""
    enabled: bool = False
    start_step: int = 10  # the first profiled step (1-based): after start-up and allocator warm-up
    num_steps: int = 3
    top_ops: int = 20  # rows of each top-operators table
    trace: bool = True  # also write a Chrome trace (chrome://tracing, Perfetto); large for big models

    def __post_init__(self) -> None:
        for name in ("start_step", "num_steps", "top_ops"):
            if getattr(self, name) < 1:
                raise ConfigError(f"profiling.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def last_step(self) -> int:
        return self.start_step + self.num_steps - 1


@dataclasses.dataclass
class EvalConfig:
    every_steps: int = 1000  # 0: only at start/end
    max_sequences: int = 4096
    micro_batch_size: int = 64
    seed: int = 4242  # the fixed masks of the held-out set
    at_start: bool = True
    at_end: bool = True


@dataclasses.dataclass
class PretrainDistillConfig:
    """General distillation (DistilBERT): the model being pretrained (the student) also learns a
    frozen teacher's MLM distribution on the same masked batches (bertdist/train/distill_objective.py).
    loss = alpha_mlm_kl * T^2 * KL(teacher_T || student_T) at the masked positions
         + alpha_mlm_ce * gold MLM cross-entropy + alpha_hidden_cos * (1 - cos) of the last hidden
           states at the real tokens + alpha_nsp * the gold NSP/SOP loss (records with one)."""
    teacher: str = ""  # a bertdist run or checkpoint dir, a torch-format dir, or an HF BertForMaskedLM/BertForPreTraining dir
    temperature: float = 2.0  # softens both MLM distributions; the KL term is scaled by T^2
    alpha_mlm_kl: float = 5.0  # DistilBERT's weights: 5 (soft targets), 2 (gold MLM), 1 (cosine)
    alpha_mlm_ce: float = 2.0
    alpha_hidden_cos: float = 0.0  # needs the teacher's hidden_size; DistilBERT uses 1.0
    alpha_nsp: float = 1.0  # the gold NSP/SOP loss, where the records carry the label; 0: MLM only

    def __post_init__(self) -> None:
        if not self.teacher:
            raise ConfigError("distill.teacher is required: a bertdist checkpoint dir or a Hugging Face "
                              "BertForMaskedLM/BertForPreTraining directory")
        if self.temperature <= 0:
            raise ConfigError(f"distill.temperature must be positive, got {self.temperature}")
        weights = {k: getattr(self, k) for k in ("alpha_mlm_kl", "alpha_mlm_ce", "alpha_hidden_cos", "alpha_nsp")}
        if any(w < 0 for w in weights.values()) or not any(weights.values()):
            raise ConfigError(f"distill: the loss weights must be >= 0 and not all 0, got {weights}")


@dataclasses.dataclass
class PretrainElectraConfig:
    """ELECTRA replaced-token detection (Clark et al., 2020; bertdist/train/electra_objective.py):
    a small generator (an MLM over the same masked batches) fills each masked position with a token
    sampled from its prediction, and the model being pretrained (the discriminator, sized by
    `model`) tells every real token replaced or original. Both share the embeddings. loss =
    gen_weight * generator MLM cross-entropy + disc_weight * discriminator binary cross-entropy
    averaged over the real tokens. No NSP: records that carry NSP labels train without them."""
    # width of the shared embeddings; null: model.hidden_size. Narrower (ELECTRA-Small: 128 under
    # hidden 256) adds a projection to each tower's hidden size
    embedding_size: Optional[int] = None
    # the generator: hidden round(ratio x model.hidden_size), heads max(1, hidden / 64), FFN 4 x hidden,
    # the discriminator's depth (the paper: 1/4 for Small and Large, 1/3 for Base); sizes set below win
    generator_size_ratio: float = 0.25
    generator_hidden_size: Optional[int] = None
    generator_num_hidden_layers: Optional[int] = None
    generator_num_attention_heads: Optional[int] = None
    generator_intermediate_size: Optional[int] = None
    disc_weight: float = 50.0  # lambda, the paper's 50
    gen_weight: float = 1.0
    temperature: float = 1.0  # the generator's logits are divided by it before sampling
    # the draw from softmax(logits / T), the same distribution either way. multinomial: one uniform per
    # masked position against the cumulative softmax (inverse CDF); gumbel: argmax(logits / T + Gumbel
    # noise), the original's, with a uniform and two logarithms per logit: ~3x the cost, 1.41x instead of
    # 1.23x an MLM step's time on a CPU (benchmarks/electra_step_time.py)
    sampling: Literal["multinomial", "gumbel"] = "multinomial"

    def __post_init__(self) -> None:
        if self.generator_size_ratio <= 0:
            raise ConfigError(f"electra.generator_size_ratio must be positive, got {self.generator_size_ratio}")
        if self.temperature <= 0:
            raise ConfigError(f"electra.temperature must be positive, got {self.temperature}")
        weights = {"gen_weight": self.gen_weight, "disc_weight": self.disc_weight}
        if any(w < 0 for w in weights.values()) or not any(weights.values()):
            raise ConfigError(f"electra: the loss weights must be >= 0 and not all 0, got {weights}")
        for name in ("embedding_size", "generator_hidden_size", "generator_num_hidden_layers",
                     "generator_num_attention_heads", "generator_intermediate_size"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"electra.{name} must be positive, got {getattr(self, name)}")

    def model_config(self, model: BertConfig) -> ElectraConfig:
        """The ELECTRA model of a run whose discriminator is ``model``, its generator sizes resolved."""
        hidden = self.generator_hidden_size or int(round(self.generator_size_ratio * model.hidden_size))
        if hidden <= 0:
            raise ConfigError(f"electra: generator hidden size round({self.generator_size_ratio} x "
                              f"{model.hidden_size}) = {hidden}; raise generator_size_ratio or set "
                              f"generator_hidden_size")
        heads = self.generator_num_attention_heads or max(1, hidden // 64)
        if hidden % heads:
            raise ConfigError(
                f"electra: the generator's hidden size {hidden} (generator_hidden_size "
                f"{self.generator_hidden_size}, or round({self.generator_size_ratio} x {model.hidden_size})) is not "
                f"divisible by its {heads} heads (generator_num_attention_heads {self.generator_num_attention_heads}, "
                f"or max(1, {hidden} // 64)); {hidden} / {heads} = {hidden / heads:.3f}")
        fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(BertConfig)}
        return ElectraConfig(**fields, embedding_size=self.embedding_size, generator_hidden_size=hidden,
                             generator_num_hidden_layers=self.generator_num_hidden_layers or model.num_hidden_layers,
                             generator_num_attention_heads=heads,
                             generator_intermediate_size=self.generator_intermediate_size or 4 * hidden)


@dataclasses.dataclass
class TrainConfig:
    run_dir: str = "runs/pretrain"
    phase: int = 1  # bookkeeping: 1 = seq 128, 2 = seq 512 (from a phase-1 checkpoint)
    seed: int = 42
    deterministic: bool = False  # torch deterministic algorithms; bitwise-exact resume on CPU
    max_steps: Optional[int] = None  # stop early (the schedule still spans schedule.total_steps)
    max_consecutive_nonfinite: int = 20
    # BERT (the default), or ModernBERT with model_type: modernbert; ELECTRA: a BERT section
    # (its discriminator) with an electra section
    model: Union[BertConfig, ModernBertConfig] = dataclasses.field(default_factory=BertConfig)
    data: LoaderConfig = dataclasses.field(default_factory=LoaderConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    deepspeed: DeepSpeedConfig = dataclasses.field(default_factory=DeepSpeedConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    profiling: ProfilingConfig = dataclasses.field(default_factory=ProfilingConfig)
    distill: Optional[PretrainDistillConfig] = None  # general distillation from a teacher; null: plain pretraining
    electra: Optional[PretrainElectraConfig] = None  # ELECTRA replaced-token detection; null: MLM (+ NSP)
    # torch.compile's cache artifacts (model.compile): loaded before the first step when the file
    # exists, written after it, so the next run on the same image starts warm. Compiled code: only a
    # file a run of yours wrote. null: only torch's own local cache.
    compile_cache: Optional[str] = None

    def __post_init__(self) -> None:
        if self.distill is not None and self.electra is not None:
            raise ConfigError("distill and electra are both set: general distillation trains a BERT's MLM head "
                              "towards a teacher, ELECTRA trains a discriminator; set one of them to null")
        family = family_of(self.model)
        if self.data.max_seq_length > self.model.max_position_embeddings:
            raise ConfigError(f"data.max_seq_length {self.data.max_seq_length} is longer than the model's context, "
                              f"model.max_position_embeddings {self.model.max_position_embeddings}; raise "
                              f"max_position_embeddings (a new phase may, for ModernBERT) or use shorter records")
        for section in OBJECTIVE_SECTIONS:
            if getattr(self, section) is not None and section not in family.objectives:
                raise ConfigError(f"{section}: a {family.name} model (model.model_type "
                                  f"{getattr(self.model, 'model_type', 'bert')!r}) trains with "
                                  f"{', '.join(family.objectives) or 'masked-LM only'}; set {section} to null")
        if self.electra is not None:
            self.electra.model_config(self.model)  # the generator's sizes resolve, or an error with the numbers
        if self.profiling.enabled and self.profiling.last_step > self.steps_to_run:
            raise ConfigError(f"profiling: steps {self.profiling.start_step}-{self.profiling.last_step} end after the "
                              f"run's last step {self.steps_to_run} (schedule.total_steps "
                              f"{self.schedule.total_steps}, max_steps {self.max_steps}); lower "
                              f"profiling.start_step or profiling.num_steps")
        if self.optimizer.implementation == "flat" and (self.deepspeed.zero_stage > 0
                                                        or self.deepspeed.precision == "fp16"):
            # The flat optimizer owns the fp32 parameters as views of its buffer; ZeRO partitions
            # them itself, and DeepSpeed's fp16 mode keeps its own fp32 copies.
            raise ConfigError(
                f"optimizer.implementation=flat needs deepspeed.zero_stage=0 and precision fp32 or bf16 (got "
                f"zero_stage {self.deepspeed.zero_stage}, precision {self.deepspeed.precision}); use "
                "implementation auto or torch there")
        self._check_cuda_graphs()
        self.weights  # bf16_weights=bf16 where it cannot run: an error with the settings
        if self.optimizer.name == "stable_adamw" and (self.deepspeed.zero_stage > 0
                                                      or self.deepspeed.precision == "fp16"):
            # As for LAMB below: its update clipping divides each tensor's lr by that tensor's RMS(g^2 / v),
            # and ZeRO (and DeepSpeed's fp16 optimizer) hand it flat buffers of many tensors instead.
            raise ConfigError(
                f"optimizer.name=stable_adamw needs deepspeed.zero_stage=0 and precision fp32 or bf16 (got "
                f"zero_stage {self.deepspeed.zero_stage}, precision {self.deepspeed.precision}): its per-tensor "
                "update clipping needs whole parameter tensors, and ZeRO 1-3 and DeepSpeed's fp16 optimizer hand "
                "the optimizer flat partitions. Use zero_stage 0 with stable_adamw, or adamw with ZeRO.")
        if self.optimizer.name == "lamb" and self.deepspeed.zero_stage > 0:
            # ZeRO flattens and partitions the parameters, so the optimizer would see slices of a flat
            # buffer instead of layers, and LAMB's per-layer trust ratio ||w|| / ||update|| would be wrong.
            raise ConfigError(
                f"optimizer.name=lamb needs deepspeed.zero_stage=0 (got {self.deepspeed.zero_stage}): LAMB's "
                "per-layer trust ratio needs whole parameter tensors, and ZeRO 1-3 hand the optimizer flat "
                "partitions. Use zero_stage 0 with LAMB (NVIDIA's BERT recipe), or adamw with ZeRO."
            )

    def _check_cuda_graphs(self) -> None:
        """``model.cuda_graphs: true`` where no graph can be captured, refused at load (the device
        type is checked when the run decides: bertdist/train/cuda_graphs.py)."""
        m, d = self.model, self.deepspeed
        if m.cuda_graphs is not True:
            return
        if m.compile is False:
            raise ConfigError("model.cuda_graphs=true captures the compiled regions in CUDA graphs, and "
                              "model.compile=false compiles none; set model.compile=true, or model.cuda_graphs=false "
                              "(or auto)")
        if d.zero_stage == 3:
            # ZeRO-3 gathers each layer's weights into fresh memory at every forward; a graph replays
            # fixed addresses, so every step would record its graphs again.
            raise ConfigError(f"model.cuda_graphs=true needs deepspeed.zero_stage 0, 1 or 2 (got {d.zero_stage}): "
                              "ZeRO-3 gathers the weights into new memory at every forward, which a CUDA graph "
                              "cannot replay; set model.cuda_graphs=false (or auto)")
        if d.activation_checkpointing != "none":
            # The recomputed forwards run inside the backward, a capture pattern not tested here.
            raise ConfigError(f"model.cuda_graphs=true with deepspeed.activation_checkpointing="
                              f"{d.activation_checkpointing} is not supported (the layers' forwards are recomputed "
                              "inside the backward); set deepspeed.activation_checkpointing=none or "
                              "model.cuda_graphs=false (or auto)")

    @property
    def model_config(self) -> "BertConfig | ModernBertConfig":
        """The model the run trains: ``model``, or with an ``electra`` section the ELECTRA model
        (``model`` is its discriminator)."""
        return self.electra.model_config(self.model) if self.electra is not None else self.model

    @property
    def objective_sections(self) -> dict[str, object]:
        """The objective sections (``OBJECTIVE_SECTIONS``), set or None: what a resume must match."""
        return {name: getattr(self, name) for name in OBJECTIVE_SECTIONS}

    @property
    def weights(self) -> str:
        """The dtype of the model's weights: "fp32", "bf16" (``deepspeed.bf16_weights`` resolved) or "fp16"."""
        from bertdist.train.precision import resolve_bf16_weights

        d = self.deepspeed
        objective = "electra" if self.electra is not None else ("distill" if self.distill is not None else None)
        try:
            return resolve_bf16_weights(d.precision, d.bf16_weights, self.optimizer.implementation, d.zero_stage,
                                        objective)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.run_dir, "checkpoints")

    @property
    def steps_to_run(self) -> int:
        return min(self.schedule.total_steps, self.max_steps or self.schedule.total_steps)


# The sections of TrainConfig that choose the objective (bertdist/train/objective.py); null: masked LM
# (+ NSP where the model has the head and the records the label).
OBJECTIVE_SECTIONS = ("distill", "electra")


def _expand_model_preset(data: dict) -> dict:
    model = data.get("model") or {}
    if not isinstance(model, dict):
        return data
    presets = section_presets(model)
    preset = model.get("preset", "base")
    if preset in presets:
        model = {**presets[preset], **model}
    return {**data, "model": model}


def train_config_from_dict(data: dict) -> TrainConfig:
    return from_dict(TrainConfig, _expand_model_preset(data))


def model_config_of(run_cfg: dict) -> "BertConfig | ModernBertConfig":
    """The model a saved run config (``bertdist_config.yaml``, a run's ``config.yaml``) describes: its
    ``model`` section, made an ELECTRA model by an ``electra`` section or by ``model_type: electra``
    (the form ``bertdist import-hf`` writes)."""
    model = run_cfg.get("model")
    if not isinstance(model, dict):
        raise ConfigError("no `model:` section")
    if run_cfg.get("electra") is not None and family_of_mapping(model).name == "bert":
        bert = from_dict(BertConfig, _expand_model_preset({"model": model})["model"])
        return from_dict(PretrainElectraConfig, run_cfg["electra"], _where="electra").model_config(bert)
    return model_config_from_mapping(model)


def load_train_config(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """A recipe YAML plus dotted overrides -> validated TrainConfig (model preset expanded)."""
    data = load_yaml(path) if path is not None else {}
    data = apply_overrides(TrainConfig, data, overrides)
    # A preset override replaces the recipe's explicit sizes, not the other way round.
    if any(o.split("=", 1)[0].strip() == "model.preset" for o in overrides):
        preset = data["model"]["preset"]
        for key in section_presets(data["model"]).get(preset, {}):
            if not any(o.split("=", 1)[0].strip() == f"model.{key}" for o in overrides):
                data["model"].pop(key, None)
    return train_config_from_dict(data)


def check_batch_sizes(data: LoaderConfig, world_size: int) -> int:
    """Gradient-accumulation steps from global = micro x accum x world, or a ConfigError with the numbers."""
    per_step = data.micro_batch_size * world_size
    if data.global_batch_size % per_step:
        lo = (data.global_batch_size // per_step) * per_step
        hint = (f"; nearest valid global batch sizes: {lo} or {lo + per_step}" if lo
                else f"; the smallest valid global batch size is {per_step}")
        fits = [m for m in range(data.micro_batch_size - 1, 0, -1) if data.global_batch_size % (m * world_size) == 0]
        if fits:
            hint += (f"; or micro_batch_size {fits[0]} (accumulation "
                     f"{data.global_batch_size // (fits[0] * world_size)})")
        raise ConfigError(
            f"global_batch_size {data.global_batch_size} is not divisible by micro_batch_size "
            f"{data.micro_batch_size} x world_size {world_size} = {per_step} "
            f"({data.global_batch_size} / {per_step} = {data.global_batch_size / per_step:.3f}){hint}"
        )
    return data.global_batch_size // per_step
