"""A Hugging Face BERT or ELECTRA directory -> ONNX models: fp32, ORT-optimised fp32, int8.

The graph comes from torch's ONNX exporter (the TorchScript-based one, ``dynamo=False``) over
the transformers model loaded with eager attention: onnxruntime's BERT fusion recognises that
attention pattern (6 of 6 MiniLM layers fused into ``Attention``), while the SDPA graph keeps
attention unfused. Optimisation is onnxruntime's transformer optimizer, quantisation its own
quantisers (bertdist.serve.quantization, with the accuracy-aware fallback of
bertdist.serve.int8_fallback): no graph is written by hand here.

Every model has dynamic batch and sequence axes (and a choice axis for multiple choice).
ELECTRA's layers are BERT's, and onnxruntime's BERT fusions find the same patterns in them.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

from bertdist.serve.card import FILES, MODEL_TYPES, OPSET, PREFIXES, TASK_ARCHITECTURES, ExportError
from bertdist.serve.quantization import MODES

INPUTS = ("input_ids", "attention_mask", "token_type_ids")
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclasses.dataclass
class SourceModel:
    """What the export reads from an HF directory."""

    path: Path
    task: str  # classification | regression | token | span | choice | encoder
    config: dict
    labels: list[str] | None
    # A sentence-transformers bi-encoder: its pooling, Dense and Normalize go into the graph.
    st_layout: object | None = None
    # A one-score model's activation for its served scores: "sigmoid" or "identity" (a
    # cross-encoder's config names it, as sentence-transformers reads it); None: raw (regression).
    activation: str | None = None


def family(config: dict) -> str:
    """The transformers class prefix of a config's model type: Bert, Electra or ModernBert."""
    return PREFIXES.get(config.get("model_type"), "Bert")


def takes_token_types(config: dict) -> bool:
    """ModernBERT has no token types: its graph takes input_ids and attention_mask only."""
    return config.get("model_type") != "modernbert"


def architecture(config: dict) -> str:
    return (config.get("architectures") or [f"{family(config)}Model"])[0]


SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
               "max_position_embeddings")


def check_sizes(conf: dict, where) -> None:
    """The model's sizes are whole positive numbers and the heads split the hidden size."""
    for key in SIZE_FIELDS + ("num_labels",):
        v = conf.get(key, 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ExportError(f"{where}: {key} is {v!r}; it must be a whole number of at least 1")
    arch, labels = conf.get("architectures"), conf.get("id2label")
    if arch is not None and (not isinstance(arch, list) or not all(isinstance(a, str) for a in arch)):
        raise ExportError(f"{where}: architectures is {arch!r}; it must be a list of class names")
    if labels is not None and (not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values())
                               or sorted(labels) != sorted(str(i) for i in range(len(labels)))):
        raise ExportError(f"{where}: id2label is {labels!r}; it must map 0, 1, ... to label names")
    if not isinstance(conf.get("problem_type") or "", str):
        raise ExportError(f"{where}: problem_type is {conf['problem_type']!r}; it must be a string")
    hidden, heads = conf.get("hidden_size"), conf.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and hidden % heads:
        raise ExportError(f"{where}: hidden_size {hidden} does not split into {heads} attention heads")


def read_weights(path: Path) -> dict | None:
    """The directory's torch-format weights read without running code (``weights_only``, refused
    unless ``--trust-checkpoint``); None when it has safetensors, which transformers reads safely."""
    from bertdist.export.safe_load import load_file

    if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
        return None
    index = path / "pytorch_model.bin.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "pytorch_model.bin").is_file():
        files = ["pytorch_model.bin"]
    else:
        raise ExportError(f"{path}: no weights (model.safetensors or pytorch_model.bin)")
    state: dict = {}
    for f in files:
        part = load_file(path / f)
        if not isinstance(part, dict):
            raise ExportError(f"{path / f}: holds a {type(part).__name__}, not a state dict")
        state.update(part)
    return state


def read_source(hf_dir: str | os.PathLike) -> SourceModel:
    p = Path(hf_dir)
    from bertdist.embed.model import is_sentence_transformers_dir, read_st_layout

    layout = read_st_layout(p) if is_sentence_transformers_dir(p) else None
    if layout is not None and layout.transformer_dir != p:
        p = layout.transformer_dir  # the weights and tokenizer live in the Transformer module's folder
    conf_path = p / "config.json"
    if not conf_path.is_file():
        raise ExportError(f"{p}: no config.json: not a Hugging Face model directory (export a run with "
                          f"`bertdist export RUN --out DIR` first, or pass the run itself)")
    try:
        conf = json.loads(conf_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportError(f"{conf_path}: not a JSON file ({e})") from None
    if not isinstance(conf, dict):
        raise ExportError(f"{conf_path}: not a JSON object")
    if conf.get("model_type") not in MODEL_TYPES:
        raise ExportError(f"{conf_path}: model_type {conf.get('model_type')!r}; the ONNX export handles "
                          f"{' and '.join(MODEL_TYPES)} models")
    if not (p / "tokenizer.json").is_file() and not (p / "vocab.txt").is_file():
        raise ExportError(f"{p}: no tokenizer.json or vocab.txt; the served model needs its tokenizer")
    check_sizes(conf, conf_path)
    arch = architecture(conf)
    if arch not in TASK_ARCHITECTURES or not arch.startswith(family(conf)):
        raise ExportError(f"{conf_path}: architecture {arch!r} is not one the export knows "
                          f"({sorted(TASK_ARCHITECTURES)})")
    task = TASK_ARCHITECTURES[arch]
    n = len(conf.get("id2label") or {}) or conf.get("num_labels", 2)
    if task == "classification" and (conf.get("problem_type") == "regression" or n == 1):
        task = "regression"
    labels = None
    if task in ("classification", "token") and conf.get("id2label"):
        labels = [conf["id2label"][str(i)] for i in range(len(conf["id2label"]))]
    activation = None
    if task == "regression":
        fn = str((conf.get("sentence_transformers") or {}).get("activation_fn", ""))
        activation = "sigmoid" if fn.endswith("Sigmoid") else ("identity" if fn else None)
    if layout is not None and task != "encoder":
        raise ExportError(f"{hf_dir}: modules.json (a sentence-transformers bi-encoder) over a {task} model")
    return SourceModel(p, task, conf, labels, layout, activation)


def default_max_length(src: SourceModel) -> int:
    """The length the model was trained and is used at: a bi-encoder's max_seq_length, else the
    tokenizer's model_max_length, capped by the position table (never past what the model can read)."""
    limit = int(src.config.get("max_position_embeddings", 512))
    if src.st_layout is not None and src.st_layout.max_seq_length:
        return min(int(src.st_layout.max_seq_length), limit)
    tc = src.path / "tokenizer_config.json"
    n = json.loads(tc.read_text()).get("model_max_length") if tc.is_file() else None
    return min(int(n), limit) if isinstance(n, (int, float)) and 0 < n < 1e9 else limit


class _ExportWrapper(nn.Module):
    """The transformers model with plain tensor outputs; for encoders the sentence embedding in the
    graph: mean pooling, or a sentence-transformers bi-encoder's pooling, Dense and Normalize."""

    def __init__(self, model: nn.Module, task: str, layout=None, token_types: bool = True):
        super().__init__()
        self.model, self.task, self.token_types = model, task, token_types
        self.pooling = layout.pooling if layout is not None else "mean"
        self.normalize = bool(layout is not None and layout.normalize)
        self.dense, self.dense_act = None, None
        if layout is not None and layout.dense is not None:
            w = layout.dense["weight"]
            self.dense = nn.Linear(w.shape[1], w.shape[0])
            with torch.no_grad():
                self.dense.weight.copy_(w.float())
                b = layout.dense["bias"]
                self.dense.bias.copy_(b.float() if b is not None else torch.zeros(w.shape[0]))
            self.dense_act = nn.Tanh() if layout.dense["activation"] == "tanh" else nn.Identity()

    def forward(self, input_ids, attention_mask, token_type_ids):
        types = {"token_type_ids": token_type_ids} if self.token_types else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, **types)
        if self.task == "encoder":
            from bertdist.embed.pooling import pool

            hidden = out.last_hidden_state
            emb = pool(hidden, attention_mask, self.pooling)
            if self.dense is not None:
                emb = self.dense_act(self.dense(emb))
            if self.normalize:
                emb = nn.functional.normalize(emb, p=2, dim=-1)
            return hidden, emb
        if self.task == "span":
            return out.start_logits, out.end_logits
        return out.logits


def output_names(task: str) -> tuple[str, ...]:
    return {"encoder": ("last_hidden_state", "sentence_embedding"), "span": ("start_logits", "end_logits")}.get(
        task, ("logits",))


def load_torch_model(src: SourceModel) -> nn.Module:
    """The transformers model, eager attention, eval mode: the export's input and the parity reference."""
    import transformers

    prefix = family(src.config)
    name = {"encoder": "Model", "classification": "ForSequenceClassification", "regression": "ForSequenceClassification",
            "token": "ForTokenClassification", "span": "ForQuestionAnswering", "choice": "ForMultipleChoice"}[src.task]
    cls = getattr(transformers, prefix + name)
    # An encoder's graph ends at the hidden states and the pooled sentence embedding: no pooler.
    kwargs = {"add_pooling_layer": False} if src.task == "encoder" and prefix == "Bert" else {}
    state = read_weights(src.path)
    try:
        if state is None:
            model = cls.from_pretrained(str(src.path), attn_implementation="eager", **kwargs)
        else:  # transformers builds from our safely read tensors
            config = cls.config_class.from_pretrained(str(src.path))
            model = cls.from_pretrained(None, config=config, state_dict=state, attn_implementation="eager", **kwargs)
    except Exception as e:  # noqa: BLE001 - whatever the directory holds that transformers cannot use
        raise ExportError(f"{src.path}: transformers cannot build {prefix}{name} from it: {type(e).__name__}: "
                          f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from None
    return _ExportWrapper(model, src.task, src.st_layout, takes_token_types(src.config)).eval()  # eval on the wrapper: the exporter restores its mode after tracing


def example_inputs(task: str, batch: int = 2, seq: int = 8, choices: int = 4) -> tuple[torch.Tensor, ...]:
    shape = (batch, choices, seq) if task == "choice" else (batch, seq)
    ids = torch.full(shape, 5, dtype=torch.long)
    mask = torch.ones(shape, dtype=torch.long)
    mask[..., -2:] = 0  # padded positions, so the mask path is traced
    return ids, mask, torch.zeros(shape, dtype=torch.long)


def graph_inputs(config: dict) -> tuple[str, ...]:
    return INPUTS if takes_token_types(config) else INPUTS[:2]


def export_fp32(model: nn.Module, task: str, out_file: Path, inputs: tuple[str, ...] = INPUTS) -> None:
    """The graph over ``inputs``; the model is always called with all three (an input the model does
    not read, ModernBERT's token types, is left out of the graph and must not be named)."""
    axes = {0: "batch", 1: "choice", 2: "sequence"} if task == "choice" else {0: "batch", 1: "sequence"}
    dyn = {name: axes for name in inputs}
    for name in output_names(task):
        dyn[name] = {0: "batch", 1: "choice"} if task == "choice" else (
            {0: "batch"} if name in ("logits", "sentence_embedding") and task != "token" else {0: "batch", 1: "sequence"})
    with torch.no_grad():
        torch.onnx.export(model, example_inputs(task), str(out_file), input_names=list(inputs),
                          output_names=list(output_names(task)), dynamic_axes=dyn, opset_version=OPSET,
                          dynamo=False)


def optimize(fp32_file: Path, out_file: Path, config: dict) -> dict[str, int]:
    """onnxruntime's BERT fusions; returns the count of each fused operator found."""
    from onnxruntime.transformers.optimizer import optimize_model

    opt = optimize_model(str(fp32_file), model_type="bert", num_heads=int(config["num_attention_heads"]),
                         hidden_size=int(config["hidden_size"]), opt_level=0)
    opt.save_model_to_file(str(out_file))
    return {k: int(v) for k, v in opt.get_fused_operator_statistics().items() if v}


def copy_tokenizer(src: Path, out: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
            copied.append(name)
    if "tokenizer.json" not in copied:  # a vocab-only directory: write the fast tokenizer's file
        from bertdist.export.tokenizer import read_tokenizer_casing, write_tokenizer_files

        lower = read_tokenizer_casing(src)
        write_tokenizer_files(out, src / "vocab.txt", True if lower is None else lower,
                              int(json.loads((src / "config.json").read_text()).get("max_position_embeddings", 512)))
        copied = [n for n in TOKENIZER_FILES if (out / n).is_file()]
    return copied


def staging_dir(out: Path) -> Path:
    """A fresh directory beside ``out``; renamed onto it only once every check has passed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))


def files_for(optimize_graph: bool, quantize: str | None) -> dict[str, str]:
    names = {"fp32": FILES["fp32"]}
    if optimize_graph:
        names["optimized"] = FILES["optimized"]
    if quantize:
        names[quantize] = FILES[quantize]
    return names


@dataclasses.dataclass
class ExportOptions:
    optimize: bool = False
    quantize: str | None = None  # "int8"
    task: str | None = None  # the fine-tuning task name of the dev set (sst2, stsb, ner, squad...)
    dev: str | None = None  # the task's data directory or dev file, for the int8 metric check
    max_eval_examples: int | None = None
    tolerance_points: float = 1.0
    int8_mode: str = "per-channel"  # bertdist.serve.quantization.MODES
    calibration: int = 256  # examples to calibrate static int8 and measure node sensitivity on
    fallback_steps: int = 8  # nodes the accuracy-aware fallback may keep in fp32; 0: none
    skip_metric_check: bool = False  # int8 without a dev set: the card says the metric was not checked
    max_length: int | None = None  # default: the model's max_position_embeddings
    threads: int | None = None
    overwrite: bool = False  # replace an earlier ONNX export in --out (never anything else)


def export_onnx(source: str | os.PathLike, out: str | os.PathLike, opts: ExportOptions | None = None,
                log=print) -> dict:
    """Export, check parity, write the card; the output appears only once every check has passed."""
    import onnxruntime

    from bertdist.serve import parity
    from bertdist.serve.card import CARD, write_card
    from bertdist.serve.runtime import make_session

    opts = opts or ExportOptions()
    out = Path(out)
    _check_out(out, opts.overwrite)
    if opts.quantize not in (None, "int8"):
        raise ExportError(f"--quantize {opts.quantize!r}: only int8 is supported")
    if opts.quantize and opts.int8_mode not in MODES:
        raise ExportError(f"--int8-mode {opts.int8_mode!r}: one of {list(MODES)}")
    src = read_source(source)
    if opts.quantize and src.task != "encoder" and not (opts.dev and opts.task) and not opts.skip_metric_check:
        raise ExportError("int8 export of a task model checks the task metric before and after: pass --task NAME "
                          "and --dev DIR_OR_FILE (the dev set), or --skip-metric-check to export it unchecked")
    if opts.quantize:
        from bertdist.serve.int8_gates import check_task

        check_task(opts.task, src.task)
    max_length = opts.max_length or default_max_length(src)
    stage = staging_dir(out)
    try:
        model = load_torch_model(src)
        files = files_for(opts.optimize, opts.quantize)
        export_fp32(model, src.task, stage / files["fp32"], graph_inputs(src.config))
        card = {"task": src.task, "labels": src.labels, "opset": OPSET, "max_length": max_length,
                "source": str(src.path), "model_type": src.config["model_type"],
                "architecture": architecture(src.config),
                "inputs": list(graph_inputs(src.config)), "outputs": list(output_names(src.task)), "files": files,
                "pooling": (src.st_layout.pooling if src.st_layout is not None else "mean") if src.task == "encoder" else None,
                "normalized": bool(src.st_layout is not None and src.st_layout.normalize),
                "activation": src.activation,
                "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__},
                "parity": {}}
        copy_tokenizer(src.path, stage)
        shutil.copyfile(src.path / "config.json", stage / "config.json")
        tok = parity.export_tokenizer(stage)
        sample = parity.encode_sample(tok, src.task, parity.sample_texts(), max_length)
        sessions = {"fp32": make_session(stage / files["fp32"], opts.threads)}
        if opts.optimize:
            card["fused"] = optimize(stage / files["fp32"], stage / files["optimized"], src.config)
            sessions["optimized"] = make_session(stage / files["optimized"], opts.threads)
        for name in sessions:
            d = parity.output_diff(model, sessions[name], sample)
            parity.check_fp32(f"{name} ({files[name]})", d)
            card["parity"][name] = {**d.as_dict(), "tolerance": parity.FP32_TOLERANCE}
            log(f"parity {name}: max |ONNX - PyTorch| {d.max_abs_diff:.2e} over {d.texts} texts "
                f"({d.tokens_min}-{d.tokens_max} tokens)")
        if opts.quantize:
            _write_int8(src, stage, files, sessions, sample, max_length, model, opts, card, log)
        write_card(stage, card)
        if out.exists():
            shutil.rmtree(out)  # an earlier ONNX export, replaced as asked (checked by _check_out)
        os.replace(stage, out)
        log(f"wrote {out}: {', '.join(files.values())}, tokenizer files, {CARD}")
        return card
    finally:
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)


def _write_int8(src: SourceModel, stage: Path, files: dict, sessions: dict, sample, max_length: int, model,
                opts: ExportOptions, card: dict, log) -> None:
    """The int8 file in ``opts.int8_mode``, through the fallback; its settings, verdict and report
    go into ``card``; refused (ParityError) when its gate does not hold within the step budget."""
    from bertdist.serve import int8_fallback, int8_gates, int8_report, parity

    inputs = int8_gates.int8_inputs(src.task, opts, stage, sessions["fp32"], sample, max_length)
    if inputs.gate is None:
        log("parity int8: task metric NOT checked (--skip-metric-check)" if opts.skip_metric_check else
            "parity int8: no dev set; nothing to check")
    res = int8_fallback.search(stage / files["fp32"], stage / files["int8"], opts.int8_mode, inputs.gate,
                               inputs.calibration, opts.fallback_steps, opts.threads, log, inputs.timed)
    if inputs.gate is not None and not res["verdict"]["within_tolerance"] and not opts.skip_metric_check:
        raise parity.ParityError(int8_fallback.refusal(inputs.gate, res["fallback"]["steps"], opts.fallback_steps))
    sessions["int8"] = res["session"]
    timing = int8_report.speed(model, sessions["fp32"], res["session"], inputs.timed, opts.threads)
    card["quantization"] = {**res["settings"], "fallback": res["fallback"]}
    card["parity"]["int8"] = res["verdict"]
    card["int8_report"] = int8_report.summary(res["verdict"], res["settings"], timing)
    for line in int8_report.log_lines(card["int8_report"]):
        log(line)


def _check_out(out: Path, overwrite: bool) -> None:
    from bertdist.serve.card import CARD

    if not out.exists():
        return
    if not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a directory")
    if not any(out.iterdir()):
        out.rmdir()
        return
    if not (out / CARD).is_file():
        raise ExportError(f"--out {out} exists and holds files that are not an ONNX export; choose another directory")
    if not overwrite:
        raise ExportError(f"--out {out} holds an earlier ONNX export; pass --overwrite to replace it")
