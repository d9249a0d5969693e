"""`bertdist data build` (the Beam pipeline) and `bertdist data vocab` (WordPiece training)."""
from __future__ import annotations

import logging
import os
import sys
import time


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("apache_beam", "root"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def run_build(args, beam_args: list[str]) -> int:
    from bertdist.config import apply_overrides, from_dict, load_yaml, to_dict
    from data_pipeline.commit import EmptyBuildError
    from data_pipeline.config import BuildConfig
    from data_pipeline.pipeline import default_pipeline_args, parse_input, run

    _setup_logging()
    data = load_yaml(args.config) if args.config else {}
    if args.input:
        data["inputs"] = [to_dict(parse_input(s)) for s in args.input]
    for key in ("output", "vocab"):
        if getattr(args, key):
            data[key] = getattr(args, key)
    cfg = from_dict(BuildConfig, apply_overrides(BuildConfig, data, args.set))
    # user flags come last: Beam's parser lets a later flag win over the defaults; a different
    # runner gets only the user's flags (the DirectRunner defaults mean nothing to it)
    user_runner = any(a.startswith("--runner") and "DirectRunner" not in a for a in beam_args)
    pipeline_args = list(beam_args) if user_runner else default_pipeline_args() + list(beam_args)
    t = time.time()
    try:
        manifest = run(cfg, pipeline_args)
    except EmptyBuildError as e:  # nothing committed; the message names the runner and what is missing
        print(f"bertdist data build: {e}", file=sys.stderr)
        return 1
    except FileNotFoundError as e:  # an input pattern that matches nothing: nothing was written
        print(f"bertdist data build: {e} (check --input KIND:PATH and the config's inputs)", file=sys.stderr)
        return 2
    print(f"data build: {manifest['splits']['train']['rows']:,} train + {manifest['splits']['heldout']['rows']:,} held-out "
          f"instances in {time.time() - t:.1f}s -> {os.path.join(cfg.output, 'manifest.json')}")
    for line in build_report(manifest):
        print(line)
    return 0


def _n(v) -> str:
    """A count, or "unknown" where the runner could not report it (null in the manifest)."""
    return "unknown" if v is None else f"{v:,}"


def build_report(manifest: dict) -> list[str]:
    """What `data build` prints after its first line: counts, held-out split, NSP negatives,
    warnings, then the Beam metrics (last: nothing is printed after them)."""
    c = manifest["counts"]
    lines = [f"  documents {_n(c['documents'])}  sentences {_n(c['sentences'])}  input words {_n(c['input_words'])}  "
             f"tokens {_n(c['tokens'])}  masked {_n(c['masked_tokens'])}"]
    h = manifest["heldout"]
    if h["fraction"] > 0:
        lines.append(f"  held-out: {h['documents']:,} documents ({h['tokens']:,} input tokens; heldout_fraction "
                     f"{h['fraction']}, at least {h['min_documents']} documents)")
    else:
        lines.append("  held-out: none (heldout_fraction 0)")
    for split, pk in (c.get("packing") or {}).items():
        fill = "" if pk["fill"] is None else f", {pk['fill']:.1%} full"
        lines.append(f"  packed {split:<8} {pk['documents']:,} documents ({pk['split_documents']:,} longer than a row, "
                     f"cut) in {pk['pieces']:,} pieces -> {pk['rows']:,} rows of "
                     f"{manifest['records']['max_seq_length']:,}{fill}; {pk['document_tokens']:,} document tokens + "
                     f"2 a piece = {pk['row_tokens']:,}")
    neg = manifest.get("negatives")
    if neg:
        lines.append(f"  NSP negatives, (document, start sentence) windows ({neg['buckets']['train']} train + "
                     f"{neg['buckets']['heldout']} held-out buckets of up to {neg['bucket_tokens']:,} tokens):")
        for split in ("train", "heldout"):
            s = neg[split]
            frac = "" if s["distinct_fraction"] is None else f" ({s['distinct_fraction']:.3f} per row)"
            lines.append(f"    {split:<8} random-next rows {s['random_next']:,}  distinct windows {s['distinct_windows']:,}"
                         f"{frac}  largest reuse {s['max_window_reuse']:,}  same-document fallbacks "
                         f"{s['same_document_fallbacks']:,}")
    for w in manifest.get("warnings", []):
        lines.append(f"  WARNING: {w}")
    if manifest["metrics"] is None:
        lines.append(f"  Beam metrics: unknown (runner {manifest.get('runner')} reports none); input words, skips and "
                     "repairs are recorded as null")
    else:
        lines.append("  Beam metrics (namespace data_pipeline):")
        for k, v in manifest["metrics"].items():
            lines.append(f"    {k:<45} {v:>12,}")
    return lines


def run_vocab(args) -> int:
    from data_pipeline.pipeline import parse_input
    from data_pipeline.tokenization import train_vocab
    from data_pipeline.vocab_corpus import iter_sentences

    _setup_logging()
    if args.existing and args.existing.endswith(".json"):
        return _existing_tokenizer(args.existing, args.output)
    if args.existing:
        from bertdist.data.vocab import load_vocab, special_token_ids, vocab_sha256

        tokens = load_vocab(args.existing)
        special_token_ids(tokens)  # raises when a special token is missing
        if os.path.abspath(args.existing) != os.path.abspath(args.output):
            os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
            with open(args.existing, "rb") as src, open(args.output, "wb") as dst:
                dst.write(src.read())
        print(f"vocab: {len(tokens):,} tokens from {args.existing} -> {args.output} (sha256 {vocab_sha256(args.output)})")
        return 0
    if not args.input:
        print("bertdist data vocab: --input is required unless --existing is given", file=sys.stderr)
        return 2
    inputs = [parse_input(s) for s in args.input]
    t = time.time()
    skipped: list[str] = []
    try:
        tokens = train_vocab(iter_sentences(inputs, skipped=skipped), args.output, vocab_size=args.size,
                             lowercase=not args.cased, min_frequency=args.min_frequency)
    except FileNotFoundError as e:
        print(f"bertdist data vocab: {e} (check --input KIND:PATH)", file=sys.stderr)
        return 2
    print(f"vocab: trained {len(tokens):,} WordPiece tokens ({'cased' if args.cased else 'uncased'}) in "
          f"{time.time() - t:.1f}s -> {args.output}")
    if skipped:
        print(f"vocab: skipped {len(skipped):,} file(s) that could not be read or decoded: "
              + ", ".join(skipped[:10]) + (" ..." if len(skipped) > 10 else ""))
    return 0


def _existing_tokenizer(existing: str, output: str) -> int:
    """``--existing tokenizer.json``: read it as a build would (special tokens, size, word marks),
    then copy it, with the tokenizer_config.json beside it, to ``output``."""
    import shutil

    from bertdist.config import ConfigError
    from bertdist.data.tokenizer_file import TOKENIZER_CONFIG_NAME, load_tokenizer_file
    from bertdist.data.vocab import vocab_sha256

    try:
        tf = load_tokenizer_file(existing)
    except ConfigError as e:
        print(f"bertdist data vocab: {e}", file=sys.stderr)
        return 2
    if os.path.abspath(existing) != os.path.abspath(output):
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        shutil.copyfile(existing, output)
        config = os.path.join(os.path.dirname(os.path.abspath(existing)), TOKENIZER_CONFIG_NAME)
        if os.path.isfile(config):
            shutil.copyfile(config, os.path.join(os.path.dirname(os.path.abspath(output)), TOKENIZER_CONFIG_NAME))
    words = f"yes ({tf.word_marks})" if tf.continuation is not None else "no (token masking only)"
    print(f"tokenizer: {tf.model_type}, {tf.size:,} ids from {existing} -> {output} (sha256 {vocab_sha256(output)}); "
          f"special tokens {tf.special}; word boundaries for whole-word masking: {words}")
    return 0


def run_squad_retrieval(args) -> int:
    from bertdist.finetune.errors import DataError
    from bertdist.retrieval.squad_split import load_squad_retrieval, write_retrieval_dir

    try:
        split = load_squad_retrieval(args.squad)
        counts = write_retrieval_dir(split, args.out)
    except DataError as e:
        print(f"bertdist data squad-retrieval: {e}")
        return 2
    c = split.counts()
    print(f"{args.out}: train.jsonl {counts['train.jsonl']:,} questions ({c['train_articles']} articles), dev.jsonl "
          f"{counts['dev.jsonl']:,} questions and corpus.jsonl {counts['corpus.jsonl']:,} paragraphs "
          f"({c['eval_articles']} other articles), queries.txt")
    return 0


def _pass_unknown_options_to_beam(parser) -> None:
    """Unknown options of `data build` are Beam pipeline options: keep them instead of failing.

    The subcommand's parser is asked with ``parse_known_args`` by the top-level parser; this
    wrapper stores the leftovers in ``args._beam_args`` and reports none unrecognised."""
    original = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        ns, extra = original(args, namespace)
        ns._beam_args = [a for a in extra if a != "--"]
        return ns, []

    parser.parse_known_args = parse_known_args


def register(sub) -> None:
    p = sub.add_parser("data", help="build training records (Beam) and vocabularies")
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    b = dsub.add_parser(
        "build", help="raw text -> sharded Parquet training records + manifest (Apache Beam)",
        description="Unknown --options are passed to Beam (e.g. --direct_num_workers=4, --runner=FlinkRunner). "
                    "Default: DirectRunner, multi_processing, one worker per local core.")
    b.add_argument("--config", help="YAML BuildConfig (configs/data/*.yaml)")
    b.add_argument("--input", action="append", default=[], metavar="[KIND:]PATH",
                   help="repeatable; KIND in wiki|books|text|jsonl, guessed from the path when omitted")
    b.add_argument("--output", help="output directory (manifest.json + shards)")
    b.add_argument("--vocab", help="vocab.txt (BERT WordPiece) or a Hugging Face tokenizer.json")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a BuildConfig field, e.g. --set max_seq_length=512")
    b.set_defaults(func=None, _data_build=True, fast_exit=True)  # see cli.main: skips 0.3 s of teardown
    _pass_unknown_options_to_beam(b)

    v = dsub.add_parser("vocab", help="train a WordPiece vocab (HF tokenizers) or take an existing vocab.txt")
    v.add_argument("--input", action="append", default=[], metavar="[KIND:]PATH")
    v.add_argument("--output", required=True, help="vocab.txt to write")
    v.add_argument("--size", type=int, default=30522)
    v.add_argument("--cased", action="store_true", help="keep case and accents (default: uncased)")
    v.add_argument("--min-frequency", type=int, default=2)
    v.add_argument("--existing", help="use this vocab.txt or Hugging Face tokenizer.json instead of training (checked, "
                   "then copied)")
    v.set_defaults(func=run_vocab)

    r = dsub.add_parser("squad-retrieval", help="SQuAD v1.1 JSON -> retrieval train/dev JSONL, a corpus and queries, "
                                                "split by article")
    r.add_argument("--squad", required=True, help="a SQuAD v1.1 JSON file, e.g. ../shared/data/squad/dev-v1.1.json")
    r.add_argument("--out", required=True, help="directory for train.jsonl, dev.jsonl, corpus.jsonl, queries.txt")
    r.set_defaults(_squad_retrieval=True)

    def dispatch(args):
        if getattr(args, "_squad_retrieval", False):
            return run_squad_retrieval(args)
        if getattr(args, "_data_build", False):
            return run_build(args, getattr(args, "_beam_args", []))
        return run_vocab(args)

    p.set_defaults(func=dispatch)
    b.set_defaults(func=dispatch)
