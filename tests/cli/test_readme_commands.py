"""Every command line README.md and the pages of docs/ show, checked from their own text (never
copied here).

Each command in a shell code block (line continuations joined, `;` splits) must match an entry of
CHECKS, else the test fails. An entry either
- runs the command verbatim with bash (cheap: seconds, no GPU, no scheduler), in page order
  (README.md first, then DOC_ORDER), in one directory shaped like the repo root (configs/ copied,
  data_pipeline/ linked in), so later lines use what earlier ones wrote, and then checks what it
  printed or wrote; or
- for commands too slow for this file or needing a GPU cluster or SLURM: parses the exact argv with
  the real parsers (bertdist's, torchrun's, `make -n`), validates the dotted overrides against the
  config schema, and checks the files it names; `where` says what runs it for real.

Skipping a block. A shell block that can neither run here nor be checked that way (it needs a GPU,
a cluster such as a Dataflow project, or runs longer than 10 minutes) carries the marker line

    <!-- not run in tests: REASON -->

directly above its opening fence. REASON starts with one of SKIP_REASONS ("GPU", "cluster",
"longer than 10 minutes"), then says what exactly, e.g. `<!-- not run in tests: cluster (a
Dataflow project and a bucket) -->`. Its commands are reported as skipped with that reason; a
marker with another reason, or not above a shell block, fails the test.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
# The docs pages in the order a user follows them; their commands run after README.md's, in this order.
DOC_ORDER = ("data.md", "pretraining.md", "fine-tuning.md", "distillation.md", "scaling-out.md", "kernels-and-gpus.md",
             "troubleshooting.md", "benchmarks.md", "design.md", "config-reference.md")
SHELL_LANGS = {"bash", "sh", "shell", "console"}
SKIP_MARKER = re.compile(r"^<!-- not run in tests: (.+?) -->$")
SKIP_REASONS = ("GPU", "cluster", "longer than 10 minutes")
# Published BertModel (with pooler) parameter counts (HF bert-base/large-uncased): the summary must agree.
PUBLISHED_PARAMS = {"base": "109,482,240", "large": "335,141,888"}


def doc_pages() -> list[Path]:
    """README.md, then the docs pages in DOC_ORDER, then any other page of docs/ by name."""
    pages = sorted(DOCS.glob("*.md"), key=lambda p: (DOC_ORDER.index(p.name) if p.name in DOC_ORDER else len(DOC_ORDER),
                                                    p.name))
    return [README, *pages]


@dataclass(frozen=True)
class ReadmeCommand:
    text: str  # as the page prints it: continuations joined, trailing comment dropped
    argv: tuple[str, ...]
    line: int  # line of the page where it starts
    page: str = "README.md"  # relative to the repository
    skip: str = ""  # the reason of the block's "not run in tests" marker

    def startswith(self, *prefix: str) -> bool:
        return self.argv[: len(prefix)] == prefix

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def _commands_in(logical: str, line: int, page: str, skip: str) -> list[ReadmeCommand]:
    text = re.sub(r"(^|\s)#.*$", "", logical).strip()  # shell comment (the pages' commands quote no '#')
    out = []
    for segment in re.split(r"\s*(?:;|&&)\s*", text):
        if segment:
            out.append(ReadmeCommand(segment, tuple(shlex.split(segment)), line, page, skip))
    return out


def readme_blocks(text: str, page: str = "README.md") -> list[tuple[str, int, list[str], str]]:
    """(language, first line number, lines, skip reason) of every fenced code block; the skip
    reason is the text of a "not run in tests" marker on the line above the fence, else ""."""
    blocks, current = [], None
    lines_of = text.splitlines()
    for no, line in enumerate(lines_of, 1):
        m = re.match(r"^```\s*(\S*)\s*$", line)
        if m and current is None:
            above = SKIP_MARKER.match(lines_of[no - 2].strip()) if no >= 2 else None
            current = (m.group(1).lower(), no + 1, [], above.group(1) if above else "")
        elif line.startswith("```") and current is not None:
            blocks.append(current)
            current = None
        elif current is not None:
            current[2].append(line)
    assert current is None, f"{page}: code block opened at line {current[1] - 1} is never closed"
    return blocks


def readme_commands(text: str | None = None, page: str = "README.md") -> list[ReadmeCommand]:
    """The commands of one page (README.md by default): every line of its shell blocks."""
    text = README.read_text(encoding="utf-8") if text is None else text
    commands = []
    for lang, first, lines, skip in readme_blocks(text, page):
        if lang not in SHELL_LANGS:
            continue
        i = 0
        while i < len(lines):
            start, logical = i, lines[i]
            while logical.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                logical = logical.rstrip()[:-1].rstrip() + " " + lines[i].strip()
            commands.extend(_commands_in(logical, first + start, page, skip))
            i += 1
    return commands


def all_commands() -> list[ReadmeCommand]:
    """Every page's commands, README.md first, in the order the workspace runs them."""
    return [c for page in doc_pages()
            for c in readme_commands(page.read_text(encoding="utf-8"), page.relative_to(REPO).as_posix())]


# ---------------------------------------------------------------------------------------------
# Helpers shared by the checks


class Workspace:
    """The pages' working directory: configs/ and data_pipeline/ as in the repo; runs/ is written."""

    def __init__(self, root: Path):
        self.root = root
        self.results: dict[ReadmeCommand, subprocess.CompletedProcess] = {}
        self.env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    def path(self, p: str) -> Path:
        return (self.root / p).resolve()

    def run(self, cmd: ReadmeCommand) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", cmd.text], cwd=self.root, env=self.env, capture_output=True,
                              text=True, timeout=300)


def parse_bertdist(args: list[str] | tuple[str, ...]):
    """bertdist's own argparse on ``args``; an argparse error fails the test with its message."""
    from bertdist.cli.main import build_parser

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return build_parser().parse_args(list(args))
        except SystemExit as e:
            pytest.fail(f"bertdist {shlex.join(args)}: argparse exit {e.code}: {err.getvalue().strip()}")


def bertdist_argv(cmd: ReadmeCommand) -> list[str]:
    """The argv bertdist's parser sees: after `bertdist`, or after `torchrun ... -m bertdist.cli.main`."""
    if cmd.argv[0] == "bertdist":
        return list(cmd.argv[1:])
    assert cmd.argv[0] == "torchrun", cmd
    from torch.distributed.run import get_args_parser

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            targs = get_args_parser().parse_args(list(cmd.argv[1:]))
        except SystemExit as e:
            pytest.fail(f"{cmd}\ntorchrun rejects its options (exit {e.code}): {err.getvalue().strip()}")
    assert targs.module and targs.training_script == "bertdist.cli.main", f"{cmd}: runs {targs.training_script}"
    return list(targs.training_script_args)


def option(argv, name: str, default=None):
    argv = list(argv)
    return argv[argv.index(name) + 1] if name in argv else default


def overrides_of(argv) -> dict[str, str]:
    return dict(a.split("=", 1) for a in argv if "=" in a and not a.startswith("-"))


def readme_preset_table() -> dict[str, str]:
    """preset -> parameter count, from the preset table of the pages (docs/pretraining.md)."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in doc_pages())
    rows = re.findall(r"^\|\s*(tiny|mini|base|large)\s*\|(?:[^|\n]*\|){4}\s*([\d,]+)\s*\|", text, re.M)
    return dict(rows)


def sbatch_lines(script: str) -> dict[str, str]:
    return dict(m.groups() for m in re.finditer(r"^#SBATCH --([\w-]+)(?:=(.*))?$", script, re.M))


def check_bash_syntax(script: str, tmp: Path) -> None:
    path = tmp / "rendered.sh"
    path.write_text(script)
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, f"rendered script is not valid bash: {r.stderr}"


# ---------------------------------------------------------------------------------------------
# Run checks: the command ran verbatim (exit 0 asserted by the caller); check what it did.


def check_info(cmd, r, ws):
    import torch

    assert re.search(rf"^\s+torch\s+{re.escape(torch.__version__)}$", r.stdout, re.M), r.stdout
    for device in ("cpu", "cuda"):
        section = r.stdout.split(f"kernels on {device}", 1)
        assert len(section) == 2, f"no kernel table for {device}:\n{r.stdout}"
        for op in ("layer_norm", "bias_dropout_add_layer_norm", "attention"):
            assert re.search(rf"^\s+{op}\s+active=(reference|fused) .* - \S", section[1], re.M), (device, op)


def check_model_summary(cmd, r, ws):
    preset, seq = option(cmd.argv, "--preset"), option(cmd.argv, "--seq-len")
    m = re.search(r"^\s*BertModel \(with pooler\)\s+([\d,]+)$", r.stdout, re.M)
    assert m, r.stdout
    table = readme_preset_table()
    assert m.group(1) == table[preset], f"summary says {m.group(1)}, the docs' preset table {table[preset]}"
    if preset in PUBLISHED_PARAMS:
        assert m.group(1) == PUBLISHED_PARAMS[preset]
    if seq:
        assert f"FLOPs per sequence at seq_len={seq}" in r.stdout
    fwd = re.search(r"^\s*forward\s+([\d.]+)([GT])$", r.stdout, re.M)
    assert fwd and float(fwd.group(1)) > 0, r.stdout


def check_data_vocab(cmd, r, ws):
    vocab = ws.path(option(cmd.argv, "--output")).read_text(encoding="utf-8").splitlines()
    assert len(vocab) == int(option(cmd.argv, "--size", 30522))
    assert {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"} <= set(vocab)
    assert any(t.startswith("##") for t in vocab), "a WordPiece vocab has continuation pieces"


def check_data_build(cmd, r, ws):
    from bertdist.data import open_records, vocab_sha256

    vocab = ws.path(option(cmd.argv, "--vocab"))
    train = open_records(ws.path(option(cmd.argv, "--output")), expect_vocab_sha256=vocab_sha256(vocab))
    assert train.num_rows > 0 and train.shards
    inputs = [a for k, a in zip(cmd.argv, cmd.argv[1:]) if k == "--input"]
    recorded = [f"{i['kind']}:{i['path']}" for i in train.manifest["config"]["inputs"]]
    assert recorded == inputs
    assert train.manifest["counts"]["documents"] > 0 and train.manifest["counts"]["instances"] > 0


def check_submit_dry_run(cmd, r, ws):
    """The rendered SLURM script asks for what the README's options say and starts the right program."""
    argv = cmd.argv
    if option(argv, "--scheduler", "slurm") != "slurm":
        assert r.stdout.strip(), cmd
        return
    script = r.stdout
    check_bash_syntax(script, ws.root)
    sb = sbatch_lines(script)
    if cmd.startswith("bertdist", "submit", "data"):
        assert sb["nodes"] == "1", sb
        assert f"data build --config {ws.path(argv[3])}" in script
        for o in argv[4:]:
            if "=" in o and not o.startswith("-"):
                assert f"--set {shlex.quote(o)}" in script, o
        return
    nodes, gpn = option(argv, "--nodes", "1"), option(argv, "--gpus-per-node")
    assert sb["nodes"] == nodes, sb
    if gpn:
        assert sb["ntasks-per-node"] == gpn and sb["gpus-per-node"] == gpn, sb
        assert f"export PROCS_PER_NODE={gpn}" in script
        assert re.search(rf"^srun .*--ntasks-per-node={gpn}\b", script, re.M)
    for opt in ("partition", "time"):
        if option(argv, f"--{opt}"):
            assert sb[opt] == option(argv, f"--{opt}"), (opt, sb)
    assert sb["chdir"] == str(ws.root.resolve()), "relative paths in the overrides resolve from the submit directory"
    assert "requeue" in sb and sb["signal"].startswith("B:TERM@"), sb
    if cmd.startswith("bertdist", "submit", "pretrain"):
        config = ws.path(argv[3])
        overrides = [a for a in argv[4:] if "=" in a and not a.startswith("-")]
        # The job re-reads the same YAML with the same overrides, and resumes by itself.
        assert f"-m bertdist.cli.main pretrain --resume auto {shlex.join([str(config), *overrides])}" in script
    else:
        assert "-m cluster.probe --out " in script


# ---------------------------------------------------------------------------------------------
# Parse checks: too slow here, or need a GPU cluster / SLURM.


def _pretrain_config(cmd: ReadmeCommand, ws: Workspace, world_size: int):
    """Parses a pretrain command, validates its overrides and checks the data it names like the trainer."""
    from bertdist.train.config import check_batch_sizes, load_train_config
    from bertdist.train.loader import open_training_records

    args = parse_bertdist(bertdist_argv(cmd))
    assert args.command == "pretrain", cmd
    overrides = list(args.overrides)
    if "..." in overrides:
        # "..." stands for the overrides of the previous pretrain line (the same run), in page order.
        ordered = all_commands()
        prev = [c for c in ordered[: ordered.index(cmd)] if is_pretrain(c) and "..." not in c.argv]
        assert prev, f"{cmd}: '...' but no earlier pretrain line to take the overrides from"
        given, earlier = overrides_of(overrides), parse_bertdist(bertdist_argv(prev[-1])).overrides
        if "run_dir" in given:
            assert given["run_dir"] == overrides_of(earlier).get("run_dir"), f"{cmd}: another run than {prev[-1]}"
        overrides = [o for o in overrides if o != "..."] + [o for o in earlier if o.split("=", 1)[0] not in given]
    config = ws.path(args.config)
    assert config.is_file(), f"{cmd}: no config {args.config}"
    cwd = Path.cwd()
    os.chdir(ws.root)  # relative data paths resolve where the README runs the command
    try:
        cfg = load_train_config(config, overrides)  # unknown keys / bad values raise ConfigError
        check_batch_sizes(cfg.data, world_size)
        for split in ("train", cfg.data.eval_split):
            if split:
                open_training_records(cfg.data.train_manifest, cfg.data.vocab_file, cfg.data.max_seq_length, split=split)
    finally:
        os.chdir(cwd)
    return args, cfg


def is_pretrain(cmd: ReadmeCommand) -> bool:
    return (cmd.startswith("torchrun") and bertdist_argv(cmd)[:1] == ["pretrain"]) or cmd.startswith("bertdist", "pretrain")


def check_torchrun(cmd, ws):
    """torchrun ... -m bertdist.cli.main COMMAND: the pretraining config for that world size, or the
    command's own check."""
    sub = bertdist_argv(cmd)[:1]
    if sub == ["pretrain"]:
        nproc = int(option(cmd.argv, "--nproc_per_node", option(cmd.argv, "--nproc-per-node", "1")))
        _pretrain_config(cmd, ws, world_size=nproc)
    elif sub == ["embed"]:
        check_embed(cmd, ws)
    else:
        raise AssertionError(f"{cmd}: no check for torchrun running `bertdist {sub[0] if sub else ''}`")


def check_pretrain(cmd, ws):
    args, cfg = _pretrain_config(cmd, ws, world_size=1)
    if args.resume not in (None, "auto"):
        assert Path(args.resume).exists(), cmd


def check_pretrain_plan(cmd, r, ws):
    """A `bertdist pretrain ... --plan` line ran here (no GPU, data or process group): the plan is for
    the world size and device the line names, and its batch arithmetic and DeepSpeed JSON agree."""
    import json

    world = int(option(cmd.argv, "--world-size", os.environ.get("WORLD_SIZE", "1")))
    if "--json" not in cmd.argv:
        assert re.search(rf"^batch: global (\d+) = micro (\d+) x accumulation (\d+) x world {world}$", r.stdout, re.M), r.stdout
        return
    plan = json.loads(r.stdout)
    b = plan["batch"]
    assert plan["world_size"] == b["world_size"] == world, plan["batch"]
    assert b["global"] == b["micro"] * b["grad_accum"] * world, b
    assert plan["ds_config"]["train_batch_size"] == b["global"]
    assert plan["ds_config"]["gradient_accumulation_steps"] == b["grad_accum"]
    assert plan["precision"]["precision"] == plan["recipe_config"]["deepspeed"]["precision"]
    if option(cmd.argv, "--device-profile") in ("h100", "a100"):
        assert plan["device_profile"]["type"] == "cuda", plan["device_profile"]
    assert 0 < plan["memory"]["total_checkpointed_gib"] <= plan["memory"]["total_gib"], plan["memory"]


def _run_dirs() -> set[str]:
    dirs = set()
    for c in all_commands():
        if is_pretrain(c) and not c.skip:
            dirs.add(overrides_of(parse_bertdist(bertdist_argv(c)).overrides).get("run_dir"))
    return dirs - {None}


def check_export(cmd, ws):
    args = parse_bertdist(bertdist_argv(cmd))
    if args.format == "onnx":
        from bertdist.finetune.tasks import TASKS
        from bertdist.serve.int8_gates import EMBED_TASKS

        models = _run_dirs() | _finetune_model_dirs() | _distill_model_dirs()
        assert args.source in models, f"{cmd}: exports {args.source}, which no pretrain, finetune or distill line writes"
        assert not args.quantize or args.task in TASKS + EMBED_TASKS or args.source in _run_dirs(), \
            f"{cmd}: int8 of a task model needs --task (one of {TASKS + EMBED_TASKS}) and --dev"
        return
    assert args.source in _run_dirs(), f"{cmd}: exports {args.source}, not a run the pages' pretrain lines write"


def _distill_model_dirs() -> set[str]:
    """OUT/model of the pages' distill lines: the student each writes."""
    return {f"{parse_bertdist(bertdist_argv(c)).out}/model" for c in all_commands() if c.startswith("bertdist", "distill")}


def _onnx_exports() -> set[str]:
    outs = set()
    for c in all_commands():
        if c.startswith("bertdist", "export"):
            args = parse_bertdist(bertdist_argv(c))
            if args.format == "onnx":
                outs.add(args.out)
    return outs


def check_serve(cmd, ws):
    args = parse_bertdist(bertdist_argv(cmd))
    missing = [d for d in args.dirs if d not in _onnx_exports()]
    assert not missing, f"{cmd}: serves {missing}, which no `bertdist export --format onnx` line of the pages writes"
    assert not args.name or len(args.name) == len(args.dirs), f"{cmd}: one --name per directory"


def check_curl(cmd, ws):
    """A curl line: a request to a port a serve line of the pages listens on, on a route it serves,
    with a JSON body whose fields that route accepts."""
    import json
    from urllib.parse import urlparse

    from bertdist.serve.runtime import FIELDS

    url = next(a for a in cmd.argv[1:] if "localhost" in a or "127.0.0.1" in a)
    u = urlparse(url if "://" in url else f"http://{url}")
    ports = {str(parse_bertdist(bertdist_argv(c)).port) for c in all_commands() if c.startswith("bertdist", "serve")}
    assert str(u.port) in ports, f"{cmd}: port {u.port}; the pages' serve lines listen on {sorted(ports)}"
    route = u.path.rsplit("/", 1)[-1]
    if route in FIELDS:
        body = json.loads(option(cmd.argv, "-d"))
        assert isinstance(body, dict) and set(body) <= FIELDS[route], f"{cmd}: fields {sorted(body)} for /{route}"
    else:
        assert u.path in ("/health", "/info", "/metrics"), f"{cmd}: no route {u.path}"


def check_import_hf(cmd, ws):
    args = parse_bertdist(bertdist_argv(cmd))
    assert args.out and args.hf_dir


def _outs(*prefix: str, **where) -> set[str]:
    """The --out (or `out_attr`) of the pages' lines starting with ``prefix`` whose parsed options match ``where``."""
    attr = where.pop("out_attr", "out")
    found = set()
    for c in all_commands():
        if c.startswith(*prefix) or (c.startswith("torchrun") and bertdist_argv(c)[: len(prefix) - 1] == list(prefix[1:])):
            args = parse_bertdist(bertdist_argv(c))
            if all(getattr(args, k) == v for k, v in where.items()):
                found.add(getattr(args, attr))
    return found


def check_data_squad_retrieval(cmd, ws):
    args = parse_bertdist(bertdist_argv(cmd))
    assert args.squad.endswith("squad/dev-v1.1.json"), f"{cmd}: the shared SQuAD v1.1 dev file"
    if (REPO / args.squad).parent.is_dir():
        assert (REPO / args.squad).is_file(), f"{cmd}: no {args.squad}"


def _embed_models(task: str) -> set[str]:
    return {f"{o}/model" for o in _outs("bertdist", "finetune", task=task)}


def check_embed_family(cmd, ws, args):
    """finetune embed|sts|rerank: the CLI's overrides load against the embedding schema; the
    checkpoint, data and teacher are what earlier lines of the pages write."""
    from bertdist.cli.finetune import cli_overrides
    from bertdist.embed.config import load_embed_config

    cfg = load_embed_config(args.config and str(REPO / args.config), cli_overrides(args))
    exports = {parse_bertdist(bertdist_argv(c)).out for c in all_commands() if c.startswith("bertdist", "export")}
    assert cfg.checkpoint in exports | _embed_models("embed") | _embed_models("sts"), \
        f"{cmd}: starts from {cfg.checkpoint}, which no export or earlier finetune line of the pages writes"
    data = _outs("bertdist", "data", "squad-retrieval") | {"../shared/data/glue/STS-B"}
    assert cfg.data in data, f"{cmd}: --data {cfg.data} is none of {sorted(data)}"
    if cfg.distill_from:
        assert cfg.distill_from in _embed_models("rerank") | _embed_models("embed"), \
            f"{cmd}: distills from {cfg.distill_from}, which no finetune rerank/embed line writes"


def check_embed(cmd, ws):
    args = parse_bertdist(bertdist_argv(cmd))
    models = _embed_models("embed") | _embed_models("sts")
    assert args.model in models, f"{cmd}: --model {args.model} is none of the pages' bi-encoders {sorted(models)}"
    data = _outs("bertdist", "data", "squad-retrieval")
    for f in args.input:
        assert str(Path(f).parent) in data, f"{cmd}: --input {f} is not a file `bertdist data squad-retrieval` writes"


def check_index(cmd, ws):
    args = parse_bertdist(bertdist_argv(cmd))
    embedded = _outs("bertdist", "embed")
    assert args.embeddings in embedded, f"{cmd}: --embeddings {args.embeddings} is none of {sorted(embedded)}"


def check_search(cmd, ws):
    args = parse_bertdist(bertdist_argv(cmd))
    indexes = _outs("bertdist", "index")
    assert args.index in indexes, f"{cmd}: --index {args.index} is none of {sorted(indexes)}"
    assert args.query or args.query_file, f"{cmd}: no query"
    if args.query_file:
        assert str(Path(args.query_file).parent) in _outs("bertdist", "data", "squad-retrieval"), cmd
    if args.rerank:
        assert args.rerank in _embed_models("rerank"), f"{cmd}: --rerank {args.rerank} is no finetune rerank model"


def check_finetune(cmd, ws):
    from bertdist.config import load_config
    from bertdist.finetune.config import FinetuneConfig
    from bertdist.finetune.tasks import TASKS

    args = parse_bertdist(bertdist_argv(cmd))
    if args.task in ("embed", "sts", "rerank"):
        check_embed_family(cmd, ws, args)
        return
    assert args.task in TASKS, f"{cmd}: unknown task {args.task}"
    exports = [parse_bertdist(bertdist_argv(c)).out for c in all_commands() if c.startswith("bertdist", "export")]
    assert args.checkpoint in exports, f"{cmd}: fine-tunes {args.checkpoint}, which no export line of the pages writes"
    # The same overrides the CLI builds, validated against the schema.
    load_config(FinetuneConfig, args.config, [f"task={args.task}", f"checkpoint={args.checkpoint}",
                                              f"data={args.data}", f"output_dir={args.out}", *args.set])


def _finetune_model_dirs() -> set[str]:
    """OUT/model of the pages' finetune lines that save their model (a task model a teacher can be)."""
    outs = set()
    for c in all_commands():
        if c.startswith("bertdist", "finetune"):
            args = parse_bertdist(bertdist_argv(c))
            if "save_model=true" in args.set:
                outs.add(f"{args.out}/model")
    return outs


def check_distill(cmd, ws):
    """A distill or pseudo-label line: the CLI's own overrides load against the distillation schema,
    the teacher is a task model an earlier finetune line saves, --labels a set an earlier line writes."""
    from bertdist.cli.distill import _overrides
    from bertdist.distill.config import load_distill_config
    from bertdist.finetune.tasks import TASKS

    args = parse_bertdist(bertdist_argv(cmd))
    labelling = args.command == "pseudo-label"
    assert args.func.__module__ == "bertdist.cli.distill", cmd
    assert args.task in TASKS, f"{cmd}: unknown task {args.task}"
    assert args.config is None or (REPO / args.config).is_file(), f"{cmd}: no config {args.config}"
    cfg = load_distill_config(args.config and str(REPO / args.config), _overrides(args, labelling=labelling))
    assert cfg.teacher in _finetune_model_dirs(), \
        f"{cmd}: teacher {cfg.teacher} is not OUT/model of a finetune line with --set save_model=true"
    if not labelling and args.labels:
        ordered = all_commands()
        labelled = [parse_bertdist(bertdist_argv(c)).out for c in ordered[: ordered.index(cmd)]
                    if c.startswith("bertdist", "pseudo-label")]
        assert args.labels in labelled, f"{cmd}: --labels {args.labels}, which no earlier pseudo-label line writes"


def check_jobs(cmd, ws):
    args = parse_bertdist(bertdist_argv(cmd))
    assert args.job_id.isdigit(), f"{cmd}: a SLURM job id is a number"
    if getattr(args, "signal", None):
        name = args.signal.upper()
        assert (name if name.startswith("SIG") else f"SIG{name}") in signal.Signals.__members__, f"{cmd}: no such signal"


def check_submit_argv(cmd, ws):
    """A submit line without --dry-run: the options parse and the job's config, overrides and data check out."""
    args = parse_bertdist(bertdist_argv(cmd))
    if args.what == "pretrain":
        from cluster.training import read_training_job

        cwd = Path.cwd()
        os.chdir(ws.root)
        try:
            read_training_job(args.config, args.overrides, check_data=True)
        finally:
            os.chdir(cwd)


def check_make(cmd, ws):
    assert shutil.which("make"), "the README's set-up needs make"
    target = cmd.argv[1]
    r = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"{cmd}: make -n {target}: {r.stderr}"
    expect = {"demo": "-m bertdist.demo", "test": "-m pytest", "gpu-acceptance": "bertdist.cli.main bench",
              "emu-check": "_emu_build driver", "emu-test": "-m pytest", "emu-sanitize": "--sanitize",
              "emu-mutate": "mutate.py", "gpu-kit": "bertdist.gpu_kit.build"}[target]
    assert expect in r.stdout, f"make {target} does not run {expect}:\n{r.stdout}"


def check_bench(cmd, ws):
    args = parse_bertdist(bertdist_argv(cmd))
    assert args.func.__module__ == "bertdist.cli.bench", f"{cmd}: not the bench command"
    assert (REPO / "benchmarks" / "acceptance.py").is_file()


def check_gpu_node_script(cmd, ws):
    """bash KIT/run.sh OUTDIR [options]: the node script's own parser, then the bench's for the rest."""
    from bertdist.gpu_kit import node

    assert cmd.argv[1] == "dist/gpu-kit/run.sh" and (REPO / "bertdist" / "gpu_kit" / "run.sh").is_file(), cmd
    args, rest = node.parse_args(["--kit", "dist/gpu-kit", "--out", *cmd.argv[2:]])
    assert args.out and not args.out.startswith("-"), f"{cmd}: OUTDIR comes first"
    parse_bertdist(["bench", *rest])


def check_pip_install(cmd, ws):
    assert cmd.argv[-1] == "." and "--no-build-isolation" in cmd.argv, f"{cmd}: expected an in-tree build against the user's torch"
    assert (REPO / "pyproject.toml").is_file() and (REPO / "setup.py").is_file()


def check_docs_generator(cmd, ws):
    """A docs generator line: the module or script exists and writes the page the line names (the
    page's own test compares its content: tests/config/test_reference.py, tests/cli/test_error_index.py,
    tests/benchmarks/test_figures.py)."""
    target = cmd.argv[cmd.argv.index(">") + 1] if ">" in cmd.argv else option(cmd.argv, "--write")
    assert target and (REPO / target).is_file(), f"{cmd}: writes {target}, which is not a page of the repository"
    source = cmd.argv[2].replace(".", "/") + ".py" if cmd.argv[1] == "-m" else cmd.argv[1]
    assert (REPO / source).is_file(), f"{cmd}: no {source}"


@dataclass(frozen=True)
class Check:
    prefix: tuple[str, ...]
    on_output: Callable | None  # (cmd, CompletedProcess, ws): the command runs verbatim here
    on_argv: Callable | None = None  # (cmd, ws): parse / validate only
    where: str = ""  # where the command runs for real when it does not run here

    def runs_here(self, cmd: ReadmeCommand) -> bool:
        # A submit line runs here only as a dry run (without it, it would really submit); a pretrain
        # line only as a --plan (without it, it would train).
        if cmd.argv[1:2] == ("pretrain",):
            return self.on_output is not None and "--plan" in cmd.argv
        return self.on_output is not None and (cmd.argv[1:2] != ("submit",) or "--dry-run" in cmd.argv)


CHECKS = [
    Check(("make", "demo"), None, check_make, "make demo (about 3 min after set-up)"),
    Check(("make", "test"), None, check_make, "make test (the suite this file is part of)"),
    Check(("make", "gpu-acceptance"), None, check_make, "a GPU machine; its CPU variant: tests/benchmarks/test_acceptance.py"),
    Check(("make", "emu-check"), None, check_make, "make emu-test; tests/emu/test_kernel_checks.py"),
    Check(("make", "emu-test"), None, check_make, "tests/emu (make test runs them)"),
    Check(("make", "emu-sanitize"), None, check_make, "by hand: an ASan + UBSan build, about 2 minutes"),
    Check(("make", "emu-mutate"), None, check_make, "tests/emu/test_mutations.py (three mutants); the full set by hand"),
    Check(("bertdist", "bench"), None, check_bench, "tests/benchmarks/test_acceptance.py (quick CPU variant); a GPU"),
    Check(("make", "gpu-kit"), None, check_make, "tests/gpu_kit/test_rehearsal.py (a kit for CI's Python)"),
    Check(("bash", "dist/gpu-kit/run.sh"), None, check_gpu_node_script,
          "a GPU node; on CPU: tests/gpu_kit/test_rehearsal.py (quick mode, in a venv standing in for the image)"),
    Check(("pip", "install"), None, check_pip_install, "tests/test_wheel_install.py (wheel into a fresh venv)"),
    Check(("python", "-m", "bertdist.config.reference"), None, check_docs_generator, "tests/config/test_reference.py"),
    Check(("python", "-m", "bertdist.cli.error_index"), None, check_docs_generator, "tests/cli/test_error_index.py"),
    Check(("python", "benchmarks/figures.py"), None, check_docs_generator, "tests/benchmarks/test_figures.py"),
    Check(("bertdist", "info"), check_info),
    Check(("bertdist", "model", "summary"), check_model_summary),
    Check(("bertdist", "data", "vocab"), check_data_vocab),
    Check(("bertdist", "data", "build"), check_data_build),
    Check(("torchrun",), None, check_torchrun, "make demo; tests/train (DeepSpeed on 2 ranks, ~80 s here)"),
    Check(("bertdist", "pretrain"), check_pretrain_plan, check_pretrain, "tests/train (resume); needs a run first"),
    Check(("bertdist", "export"), None, check_export, "make demo; tests/export (needs a pretraining run)"),
    Check(("bertdist", "data", "squad-retrieval"), None, check_data_squad_retrieval,
          "tests/retrieval/test_squad_split.py (the real SQuAD file)"),
    Check(("bertdist", "embed"), None, check_embed,
          "tests/retrieval/test_embed_job.py (2 ranks); tests/test_stored_set.py (a kill and a resume)"),
    Check(("bertdist", "index"), None, check_index, "tests/retrieval/test_index.py"),
    Check(("bertdist", "search"), None, check_search, "tests/retrieval/test_search.py (rerank and hybrid)"),
    Check(("bertdist", "serve"), None, check_serve, "tests/serve/test_server.py (a real server under a bounded load)"),
    Check(("curl",), None, check_curl, "tests/serve/test_server.py (the same bodies over real HTTP)"),
    Check(("bertdist", "import-hf"), None, check_import_hf,
          "tests/export/test_import_pretrain.py (DeepSpeed CPU init, ~60 s here)"),
    Check(("bertdist", "finetune"), None, check_finetune, "make demo; tests/finetune (full SST-2 is slow)"),
    Check(("bertdist", "pseudo-label"), None, check_distill,
          "tests/distill (tiny teachers: every task family); tests/test_stored_set.py (resume)"),
    Check(("bertdist", "distill"), None, check_distill, "tests/distill (tiny teachers, exported students); benchmarks/distill.py"),
    Check(("bertdist", "submit"), check_submit_dry_run, check_submit_argv, "tests/cluster (real SLURM)"),
    Check(("bertdist", "jobs"), None, check_jobs, "tests/cluster/test_slurm_real.py (real SLURM)"),
]


def check_for(cmd: ReadmeCommand) -> Check | None:
    matches = [c for c in CHECKS if cmd.startswith(*c.prefix)]
    return max(matches, key=lambda c: len(c.prefix)) if matches else None


COMMANDS = all_commands()
RUN = [c for c in COMMANDS if not c.skip]  # run or parse-checked here
SKIPPED = [c for c in COMMANDS if c.skip]  # in a block marked "not run in tests"


def _generated_sections_removed(text: str) -> str:
    """A page without its generated sections (error messages quote commands as the code says them)."""
    return re.sub(r"<!-- BEGIN [^>]*-->.*?<!-- END [^>]*-->", "", text, flags=re.S)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Workspace:
    """Runs every cheap command once, in page order, in a repo-shaped directory. configs/ is a copy:
    a Kubernetes job must find its config under the work directory its pods mount."""
    ws = Workspace(tmp_path_factory.mktemp("readme"))
    shutil.copytree(REPO / "configs", ws.root / "configs")
    (ws.root / "data_pipeline").symlink_to(REPO / "data_pipeline")
    for cmd in RUN:
        check = check_for(cmd)
        if check and check.runs_here(cmd):
            ws.results[cmd] = ws.run(cmd)
    return ws


def test_pages_have_commands_and_each_has_a_check():
    assert len(readme_commands()) >= 5 and len(COMMANDS) >= 30, COMMANDS
    assert {c.page for c in COMMANDS} >= {"README.md", "docs/data.md", "docs/pretraining.md", "docs/scaling-out.md"}
    missing = [str(c) for c in RUN if check_for(c) is None]
    assert not missing, "commands no test checks (add a Check, or mark the block as not run):\n" + "\n".join(missing)


def test_skip_markers_state_an_allowed_reason_above_a_shell_block():
    bad = []
    for page in doc_pages():
        name = page.relative_to(REPO).as_posix()
        lines = page.read_text(encoding="utf-8").splitlines()
        for no, line in enumerate(lines, 1):
            m = SKIP_MARKER.match(line.strip())
            if line.strip().startswith("<!--") and "not run in tests" in line and not m:
                bad.append(f"{name}:{no}: malformed marker {line.strip()!r}")
            elif m:
                fence = re.match(r"^```\s*(\S*)\s*$", lines[no]) if no < len(lines) else None
                if not fence or fence.group(1).lower() not in SHELL_LANGS:
                    bad.append(f"{name}:{no}: the marker is not directly above a shell block")
                if not m.group(1).startswith(SKIP_REASONS):
                    bad.append(f"{name}:{no}: reason {m.group(1)!r} does not start with one of {SKIP_REASONS}")
    assert not bad, "\n".join(bad)


def test_skip_markers_are_read():
    text = "x\n<!-- not run in tests: GPU (an H100) -->\n```bash\nbertdist bench\n```\n```bash\nbertdist info\n```\n"
    cmds = readme_commands(text, "t.md")
    assert [(c.text, c.skip) for c in cmds] == [("bertdist bench", "GPU (an H100)"), ("bertdist info", "")]


def test_no_commands_hide_in_unlabelled_blocks():
    # Commands in a block without a shell language would escape this file; the diagram block has none.
    starts = ("bertdist ", "make ", "torchrun ", "deepspeed ", "python ", "pip ")
    for page in doc_pages():
        name = page.relative_to(REPO).as_posix()
        for lang, first, lines, _ in readme_blocks(page.read_text(encoding="utf-8"), name):
            if lang not in SHELL_LANGS:
                bad = [f"{name}:{first + i}: {l}" for i, l in enumerate(lines) if l.strip().startswith(starts)]
                assert not bad, f"commands in a ```{lang} block; label it ```bash:\n" + "\n".join(bad)


@pytest.mark.slow  # every command of the pages as a subprocess, on a workspace built first: 70-105 s on 2 cores
@pytest.mark.parametrize("cmd", COMMANDS, ids=[f"{Path(c.page).stem}-L{c.line}-{'_'.join(c.argv[:3])}" for c in COMMANDS])
def test_readme_command(cmd, workspace):
    if cmd.skip:
        pytest.skip(f"{cmd.page}:{cmd.line}: not run in tests: {cmd.skip}")
    check = check_for(cmd)
    assert check is not None, f"{cmd}: no check"
    if check.runs_here(cmd):
        r = workspace.results[cmd]
        assert r.returncode == 0, f"{cmd}\nexit {r.returncode}\n{r.stderr[-3000:]}"
        check.on_output(cmd, r, workspace)
    else:
        check.on_argv(cmd, workspace)


@pytest.mark.shared
def test_readme_finetune_data_is_the_task_layout(shared_data):
    """The data directory the README's finetune line names holds the task's train and dev TSVs."""
    lines = [c for c in readme_commands() if c.startswith("bertdist", "finetune")]
    assert lines
    for cmd in lines:
        args = parse_bertdist(bertdist_argv(cmd))
        data = (REPO / args.data).resolve()  # the README runs from the repo root
        for split in ("train.tsv", "dev.tsv"):
            header = (data / split).open(encoding="utf-8").readline().rstrip("\n").split("\t")
            assert header[0] == "sentence" and header[-1] == "label", (cmd, split, header)


def _leaf_commands() -> list[str]:
    from bertdist.cli.main import build_parser

    def walk(parser, path):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return [" ".join(path)]
        return [leaf for name, p in subs[0].choices.items() for leaf in walk(p, [*path, name])]

    return walk(build_parser(), [])


@pytest.mark.parametrize("leaf", _leaf_commands())
def test_every_cli_command_has_an_example_in_the_pages(leaf):
    words = tuple(leaf.split())
    assert any(bertdist_argv(c)[: len(words)] == list(words) for c in RUN if c.argv[0] in ("bertdist", "torchrun")), \
        f"neither README.md nor docs/ shows a `bertdist {leaf}` example that a test checks"


def test_inline_bertdist_spans_name_real_commands_and_options():
    """Prose spans such as `bertdist submit pretrain ... --nodes N` name commands and options that exist."""
    from bertdist.cli.main import build_parser

    spans = [(page.relative_to(REPO).as_posix(), span) for page in doc_pages()
             for span in re.findall(r"`(bertdist [^`]+)`", _generated_sections_removed(page.read_text(encoding="utf-8")))]
    assert len(spans) > 5
    for page, span in spans:
        parser, words = build_parser(), shlex.split(span)[1:]
        while words:
            subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            if not subs or words[0].startswith("-") or words[0] == "...":
                break
            assert words[0] in subs[0].choices, f"{page}: `{span}`: no command {words[0]!r}"
            parser, words = subs[0].choices[words[0]], words[1:]
        known = {s for a in parser._actions for s in a.option_strings}
        for w in words:
            if w.startswith("--"):
                assert w.split("=", 1)[0] in known, f"{page}: `{span}`: {parser.prog} has no option {w}"


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", re.sub(r"```.*?```", "", text, flags=re.S), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        out.add(slug)
    return out


def test_links_between_pages_resolve():
    """Every relative link of README.md and docs/ names a file that exists, and its #anchor a heading there."""
    bad = []
    for page in doc_pages():
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(REPO)}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text(encoding="utf-8")):
                bad.append(f"{page.relative_to(REPO)}: {target}: no heading #{anchor} in {dest.name}")
    assert not bad, "\n".join(bad)
