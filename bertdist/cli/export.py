"""`bertdist export`: a run or DeepSpeed checkpoint (or an HF dir) -> a Hugging Face or torch directory."""
from __future__ import annotations


def run(args) -> int:
    from bertdist.export.sources import data_tokenizer_problem, load_pretrained, write_torch_dir
    from bertdist.export.hf import ExportError
    from bertdist.export.safe_load import trust_checkpoints

    if args.format == "onnx":
        return run_onnx(args)
    lower = {"cased": False, "uncased": True, None: None}[args.casing]
    try:
        with trust_checkpoints(args.trust_checkpoint):
            w = load_pretrained(args.source, vocab_file=args.vocab, do_lower_case=lower, tag=args.tag)
    except (ExportError, FileNotFoundError) as e:
        print(f"bertdist export: {e}")
        return 2
    problem = data_tokenizer_problem(w)
    if problem is not None:
        print(f"bertdist export: {problem}")
        return 2
    print(f"read {w.origin.get('kind')} checkpoint {w.origin.get('path')}"
          + (f" (tag {w.origin['tag']}, ZeRO stage {w.origin['zero_stage']}, world size {w.origin['world_size']})"
             if w.origin.get("kind") == "deepspeed" else ""))
    if args.format == "torch":
        out = write_torch_dir(args.out, w)
        print(f"wrote {out} (bertdist torch format)")
        return 0
    from bertdist.model.families import family_of

    return family_of(w.config).export(args, w)  # the family's HF directory (bertdist/model/families.py)


def export_bert(args, w) -> int:
    """A BERT as ``BertForPreTraining``, an ELECTRA as ``ElectraForPreTraining`` (its generator in
    generator/), with the WordPiece vocab and tokenizer files."""
    from bertdist.export import write_hf_dir
    from bertdist.export.hf import ExportError
    from bertdist.model.families import family_of

    if w.vocab_file is None:
        print("bertdist export: the checkpoint does not name its vocab file; pass --vocab FILE")
        return 2
    try:
        out = write_hf_dir(args.out, w.config, w.state_dict, w.vocab_file, w.do_lower_case)
    except ExportError as e:
        print(f"bertdist export: {e}")
        return 2
    family = family_of(w.config)
    electra = family.name == "electra"
    print(f"wrote {out}: config.json, model.safetensors ({family.hf_architecture}), vocab.txt, tokenizer files "
          f"({'uncased' if w.do_lower_case else 'cased'})")
    if not args.no_verify:
        from bertdist.export.verify import max_logit_diff

        d = max_logit_diff(out, w.config, w.state_dict)
        ok = d["mlm"] <= 1e-4 and d["nsp"] <= 1e-4
        names = ("generator MLM", "discriminator") if electra else ("MLM", "NSP")
        print(f"verify: max |ours - transformers| logits on a padded fp32 batch: {names[0]} {d['mlm']:.2e}, "
              f"{names[1]} {d['nsp']:.2e} -> {'OK' if ok else 'MISMATCH'}")
        if not ok:
            return 1
    return 0


def export_modernbert(args, w) -> int:
    """A ModernBERT model as a ``ModernBertForMaskedLM`` directory with the tokenizer it was trained
    with: its tokenizer files carried along, or the WordPiece vocab's tokenizer files."""
    from bertdist.export.hf import ExportError
    from bertdist.export.modernbert_hf import write_modernbert_hf_dir
    from bertdist.export.tokenizer import write_modernbert_tokenizer

    try:
        out = write_modernbert_hf_dir(args.out, w.config, w.state_dict, w.tokenizer_files)
    except ExportError as e:
        print(f"bertdist export: {e}")
        return 2
    names = list(dict.fromkeys([f.name for f in w.tokenizer_files] + write_modernbert_tokenizer(out, w)))
    print(f"wrote {out}: config.json, model.safetensors (ModernBertForMaskedLM)"
          + (f", {', '.join(names)}" if names else ", no tokenizer files"))
    return 0 if args.no_verify else verify_modernbert(out, w, "bertdist export")


def verify_modernbert(hf_dir, w, command: str) -> int:
    """0 when our ModernBERT, padded and packed, gives transformers' logits within 1e-4; else 1."""
    from bertdist.export.verify import modernbert_max_logit_diff

    d = modernbert_max_logit_diff(hf_dir, w.config, w.state_dict)
    ok = max(d.values()) <= 1e-4
    print(f"verify: max |ours - transformers| MLM logits (fp32): padded {d['mlm']:.2e}, packed {d['mlm_packed']:.2e}"
          f" -> {'OK' if ok else 'MISMATCH'}")
    if not ok:
        print(f"{command}: our model does not reproduce the HF model's outputs")
    return 0 if ok else 1


def run_onnx(args) -> int:
    """``--format onnx``: an HF directory (task model, student, encoder) as is; a run or checkpoint
    through a temporary HF directory of its encoder."""
    import tempfile

    from bertdist.export.hf import ExportError as HFExportError
    from bertdist.export.hf import is_hf_dir
    from bertdist.serve.card import ExportError
    from bertdist.serve.onnx_export import ExportOptions, export_onnx

    opts = ExportOptions(optimize=args.optimize, quantize=args.quantize, task=args.task, dev=args.dev,
                         max_eval_examples=args.max_eval_examples, tolerance_points=args.int8_tolerance,
                         int8_mode=args.int8_mode, calibration=args.calibration, fallback_steps=args.int8_fallback_steps,
                         skip_metric_check=args.skip_metric_check, threads=args.threads, overwrite=args.overwrite)
    from bertdist.export.safe_load import trust_checkpoints

    try:
        if is_hf_dir(args.source):
            with trust_checkpoints(args.trust_checkpoint):
                export_onnx(args.source, args.out, opts)
            return 0
        from bertdist.export.sources import load_pretrained

        lower = {"cased": False, "uncased": True, None: None}[args.casing]
        with trust_checkpoints(args.trust_checkpoint):
            w = load_pretrained(args.source, vocab_file=args.vocab, do_lower_case=lower, tag=args.tag)
        from bertdist.export.sources import data_tokenizer_problem

        problem = data_tokenizer_problem(w)
        if problem is not None:
            print(f"bertdist export: {problem}")
            return 2
        if w.vocab_file is None and w.tokenizer_json is None:
            print("bertdist export: the checkpoint does not name its vocab file; pass --vocab FILE")
            return 2
        from bertdist.export.encoders import family_of

        with tempfile.TemporaryDirectory(prefix="bertdist-onnx-") as tmp:
            hf = family_of(w.config).write_pretraining_dir(f"{tmp}/hf", w)
            export_onnx(hf, args.out, opts)
        return 0
    except (ExportError, HFExportError, FileNotFoundError) as e:
        print(f"bertdist export: {e}")
        from bertdist.export.safe_load import UnsafeCheckpointError
        from bertdist.serve.parity import ParityError

        return 1 if isinstance(e, (ParityError, UnsafeCheckpointError)) else 2  # a check refused it


def register(sub) -> None:
    from bertdist.serve.int8_fallback import DEFAULT_STEPS
    from bertdist.serve.quantization import DEFAULT_CALIBRATION, DEFAULT_MODE, MODES

    p = sub.add_parser("export", help="export a run/checkpoint to a Hugging Face (or torch) model directory")
    p.add_argument("source", help="run dir, DeepSpeed save dir (with `latest`), one checkpoint dir, or an HF dir")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--format", choices=["hf", "torch", "onnx"], default="hf",
                   help="onnx: fp32 ONNX with dynamic axes, checked against PyTorch (see docs/serving.md)")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in `latest`)")
    p.add_argument("--vocab", default=None, help="vocab.txt, when the run's config does not name it")
    p.add_argument("--casing", choices=["cased", "uncased"], default=None,
                   help="tokenizer casing (default: from the run's config, else inferred from the vocab)")
    p.add_argument("--no-verify", action="store_true", help="skip the logits comparison with transformers")
    o = p.add_argument_group("ONNX (--format onnx)")
    o.add_argument("--optimize", action="store_true",
                   help="also write model.optimized.onnx with onnxruntime's BERT fusions (attention, LayerNorm, GELU)")
    o.add_argument("--quantize", choices=["int8"], default=None,
                   help="also write model.int8.onnx, refused if the dev metric drops beyond --int8-tolerance "
                        "once the fallback has kept up to --int8-fallback-steps nodes in fp32")
    o.add_argument("--int8-mode", choices=list(MODES), default=DEFAULT_MODE,
                   help="dynamic: per-tensor weights; per-channel (default): a weight scale per output channel; "
                        "static: QDQ with activation scales calibrated on --calibration examples")
    o.add_argument("--calibration", type=int, default=DEFAULT_CALIBRATION, metavar="N",
                   help="examples (the task's train rows, else its dev rows) that calibrate static int8 and "
                        "measure each node's sensitivity (default %(default)s)")
    o.add_argument("--int8-fallback-steps", type=int, default=DEFAULT_STEPS, metavar="N",
                   help="when int8 misses the tolerance, keep the most sensitive nodes in fp32, one per step, "
                        "up to N (default %(default)s; 0: refuse at once)")
    o.add_argument("--task", default=None, help="the task of --dev for the int8 check (sst2, stsb, mrpc, ner, squad...; "
                                                "sts, embed, rerank for bi- and cross-encoders)")
    o.add_argument("--dev", default=None, help="the task's data directory or dev file, for the int8 metric check")
    o.add_argument("--max-eval-examples", type=int, default=None, help="check int8 on the first N dev examples")
    o.add_argument("--int8-tolerance", type=float, default=1.0,
                   help="largest accepted drop of the dev metric, in points (0.01 accuracy/F1/Spearman; default 1)")
    o.add_argument("--skip-metric-check", action="store_true", help="write int8 without checking a dev metric")
    o.add_argument("--threads", type=int, default=None, help="onnxruntime threads for the checks")
    o.add_argument("--overwrite", action="store_true", help="replace an earlier ONNX export in --out")
    add_trust_flag(p)
    p.set_defaults(func=run)


def add_trust_flag(p) -> None:
    """``--trust-checkpoint`` (bertdist.export.safe_load.TRUST_FLAG), for the commands that read checkpoints."""
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="also load checkpoint files that need full unpickling (e.g. from an older bertdist); "
                        "unpickling runs any code a file holds, so only for checkpoints from a source you trust")
