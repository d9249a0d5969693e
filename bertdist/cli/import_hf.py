"""`bertdist import-hf`: an existing Hugging Face BERT (or ELECTRA) -> a bertdist init checkpoint.

The default output is a DeepSpeed checkpoint in the trainer's layout: ``bertdist
pretrain ... checkpoint.init_from=OUT checkpoint.init_load_optimizer=false`` continues
pretraining from it (domain adaptation, BioBERT-style), and ``bertdist finetune
--checkpoint OUT`` / ``bertdist export OUT`` read it too.
"""
from __future__ import annotations

from bertdist.cli.export import add_trust_flag


def run(args) -> int:
    from bertdist.export.hf import ExportError, is_hf_dir
    from bertdist.export.safe_load import trust_checkpoints
    from bertdist.export.sources import load_pretrained

    if not is_hf_dir(args.hf_dir):  # checked first: nothing else in the directory is read
        print(f"bertdist import-hf: {args.hf_dir} is not a Hugging Face model directory "
              "(no config.json with model.safetensors or pytorch_model.bin)")
        return 2
    lower = {"cased": False, "uncased": True, None: None}[args.casing]
    try:
        with trust_checkpoints(args.trust_checkpoint):
            w = load_pretrained(args.hf_dir, vocab_file=args.vocab, do_lower_case=lower)
    except (ExportError, FileNotFoundError) as e:
        print(f"bertdist import-hf: {e}")
        return 2
    from bertdist.model.families import family_of

    return family_of(w.config).import_(args, w)  # the family's import (bertdist/model/families.py)


def import_bert(args, w) -> int:
    """An HF BERT or ELECTRA, checked against transformers, as a trainer init checkpoint or torch dir."""
    from bertdist.model import ElectraConfig

    fresh = w.origin.get("newly_initialised") or []
    electra = isinstance(w.config, ElectraConfig)
    if not args.no_verify:
        from bertdist.export.verify import electra_max_logit_diff, max_logit_diff

        if not fresh and electra:
            d = electra_max_logit_diff(args.hf_dir, w.config, w.state_dict)
            names = {"discriminator": "discriminator", "generator_mlm": "generator MLM"}
            print("verify: max |ours - transformers| logits: "
                  + ", ".join(f"{names[k]} {v:.2e}" for k, v in d.items()))
        elif not fresh:
            d = max_logit_diff(args.hf_dir, w.config, w.state_dict)
            print(f"verify: max |ours - transformers| logits: MLM {d['mlm']:.2e}, NSP {d['nsp']:.2e}")
        if not fresh and max(d.values()) > 1e-4:
            print("bertdist import-hf: our model does not reproduce the HF model's outputs")
            return 1
    out = _write(args, w)
    if out is None:
        return 2
    c = w.config
    what = "BERT"
    if electra:
        what = (f"ELECTRA discriminator E={c.embedding_width}" + (
            f" + generator L={c.generator_num_hidden_layers} H={c.generator_hidden_size}" if c.has_generator else
            " (no generator)") + ",")
    print(f"wrote {out}: {what} L={c.num_hidden_layers} H={c.hidden_size} A={c.num_attention_heads} "
          f"vocab={c.vocab_size} ({'uncased' if w.do_lower_case else 'cased'})")
    if fresh:
        print(f"note: the HF checkpoint had no {sorted({k.rsplit('.', 1)[0] for k in fresh})}; newly initialised")
    print(f"fine-tune: bertdist finetune <task> --checkpoint {out} --data DIR")
    if args.format == "deepspeed":
        print("continue pretraining: bertdist pretrain CONFIG "
              f"checkpoint.init_from={out} checkpoint.init_load_optimizer=false data.vocab_file={out}/vocab.txt "
              f"model.preset=custom model.hidden_size={c.hidden_size} model.num_hidden_layers={c.num_hidden_layers} "
              f"model.num_attention_heads={c.num_attention_heads} model.intermediate_size={c.intermediate_size} "
              f"model.max_position_embeddings={c.max_position_embeddings} model.type_vocab_size={c.type_vocab_size}"
              + (f" electra.embedding_size={c.embedding_width} electra.generator_hidden_size={c.generator_hidden_size}"
                 f" electra.generator_num_hidden_layers={c.generator_num_hidden_layers}"
                 f" electra.generator_num_attention_heads={c.generator_num_attention_heads}"
                 f" electra.generator_intermediate_size={c.generator_intermediate_size}" if electra else "")
              + " (records must be built with the same vocab)")
    return 0


def import_modernbert(args, w) -> int:
    """A ``ModernBertForMaskedLM`` directory, checked against transformers (padded and packed), as a
    trainer init checkpoint (continued pretraining: checkpoint.init_from) or our torch format."""
    from bertdist.cli.export import verify_modernbert

    if not args.no_verify and verify_modernbert(args.hf_dir, w, "bertdist import-hf"):
        return 1
    out = _write(args, w)
    if out is None:
        return 2
    c = w.config
    print(f"wrote {out}: ModernBERT L={c.num_hidden_layers} H={c.hidden_size} A={c.num_attention_heads} "
          f"vocab={c.vocab_size} context={c.max_position_embeddings} window={c.local_attention} "
          f"(global every {c.global_attn_every_n_layers} layers)")
    if args.format == "deepspeed":
        keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "global_attn_every_n_layers", "local_attention", "global_rope_theta",
                "local_rope_theta", "pad_token_id", "cls_token_id", "sep_token_id", "bos_token_id", "eos_token_id")
        print("continue pretraining: bertdist pretrain CONFIG "
              f"checkpoint.init_from={out} checkpoint.init_load_optimizer=false model.model_type=modernbert "
              "model.preset=custom " + " ".join(f"model.{k}={getattr(c, k)}" for k in keys)
              + " (records must be built with the model's tokenizer; a new phase may change "
                "max_position_embeddings and global_rope_theta)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("import-hf", help="turn a Hugging Face BERT, ELECTRA or ModernBERT directory into a bertdist "
                                         "init checkpoint")
    p.add_argument("hf_dir", help="directory with config.json, model.safetensors (or pytorch_model.bin), vocab.txt; "
                                  "ELECTRA: the discriminator's, with the generator's in generator/")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab", default=None, help="vocab.txt, when the HF dir has none")
    p.add_argument("--casing", choices=["cased", "uncased"], default=None)
    p.add_argument("--format", choices=["deepspeed", "torch"], default="deepspeed",
                   help="deepspeed (default): a checkpoint `bertdist pretrain` can start from (checkpoint.init_from) "
                        "and finetune/export read; torch: a plain state dict + config (fine-tuning and export only)")
    p.add_argument("--no-verify", action="store_true", help="skip the logits comparison with transformers")
    add_trust_flag(p)
    p.set_defaults(func=run)


def _write(args, w):
    """The imported weights written in ``--format`` (our torch directory, or a trainer init
    checkpoint for continued pretraining); None after printing why not."""
    from bertdist.export.hf import ExportError
    from bertdist.export.sources import write_torch_dir

    try:
        if args.format == "torch":
            return write_torch_dir(args.out, w)
        from bertdist.export.trainer_init import write_trainer_init

        return write_trainer_init(args.out, w, str(args.hf_dir))
    except ExportError as e:
        print(f"bertdist import-hf: {e}")
        return None
