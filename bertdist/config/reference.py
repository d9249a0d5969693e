"""The config reference: every key of the config schemas, with its type, default and comment, as
Markdown (docs/config-reference.md is this module's output).

    python -m bertdist.config.reference > docs/config-reference.md

The schemas are the dataclasses themselves; the comments are read from their source with
``tokenize`` (the comment on a field's line, and full-line comments right above it), so the
reference says what the code says. Schema modules are imported by name: none of them imports torch
or Beam, and this module imports no schema module at load time.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from typing import Any

from bertdist.config.schema import _strip_optional, dataclass_members

# (title, schema class as "module:Class", where its instances live, how a key is set)
SCHEMAS = (
    ("Pretraining", "bertdist.train.config:TrainConfig", "configs/pretrain/*.yaml",
     "`bertdist pretrain CONFIG key.path=value`"),
    ("Data build", "data_pipeline.config:BuildConfig", "configs/data/*.yaml",
     "`bertdist data build --config CONFIG --set key.path=value`"),
    ("Fine-tuning", "bertdist.finetune.config:FinetuneConfig", "configs/finetune/*.yaml",
     "`bertdist finetune TASK --config CONFIG --set key.path=value`"),
    ("Embeddings and re-ranking", "bertdist.embed.config:EmbedConfig", "configs/embed/*.yaml",
     "`bertdist finetune embed|sts|rerank --config CONFIG --set key=value` ([embeddings](embeddings.md))"),
    ("Task distillation", "bertdist.distill.config:DistillConfig", "configs/distill/*.yaml",
     "`bertdist distill TASK --config CONFIG --set key.path=value` (`bertdist pseudo-label` reads the same keys)"),
    ("Cluster resources", "cluster.spec:Resources", "options of `bertdist submit`",
     "`bertdist submit pretrain ... --nodes N --gpus-per-node G` (one option per key, `-` for `_`)"),
    ("GPU node image", "bertdist.gpu_kit.image:ImageManifest", "configs/images/*.yaml",
     "one file per site image: `make gpu-kit GPU_KIT_IMAGE=FILE` ([GPU node](gpu-node.md))"),
)


def load_schema(ref: str) -> type:
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def field_comments(cls: type) -> dict[str, str]:
    """field name -> its comment: the full-line comments right above the field, then the comment on
    its line, joined with spaces."""
    source = textwrap.dedent(inspect.getsource(cls))
    fields = {f.name for f in dataclasses.fields(cls)}
    lines = source.splitlines()
    comments: dict[int, str] = {}  # line number -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    out = {}
    for no, line in enumerate(lines, 1):
        head = line.strip().split(":", 1)[0]
        if line.startswith("    ") and not line.startswith("     ") and head in fields and ":" in line \
                and head not in out:
            above, k = [], no - 1
            while k >= 1 and lines[k - 1].strip().startswith("#"):
                if not comments.get(k, "").startswith("---"):  # "# --- section ---" heads a group, not a field
                    above.insert(0, comments.get(k, ""))
                k -= 1
            out[head] = " ".join([*above, *([comments[no]] if no in comments else [])]).strip()
    return out


def type_name(tp: Any) -> str:
    """A type as a user writes its values: ``int``, ``"a" | "b"``, ``float | None``, ``list[str]``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return " \\| ".join(f'"{a}"' if isinstance(a, str) else str(a).lower() for a in args)
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        return " \\| ".join(type_name(a) for a in args)
    if tp is type(None):
        return "None"
    if origin is not None:
        inner = ", ".join(type_name(a) for a in args if a is not Ellipsis)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]" if inner else origin.__name__
    return getattr(tp, "__name__", str(tp))


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def default_text(value: Any) -> str:
    if value is dataclasses.MISSING:
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        value = list(value)
    return str(value)


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def rows(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, comment) of every leaf key, nested sections dotted."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.extend(rows(tp, f"{prefix}{f.name}."))
            continue
        if len(dataclass_members(tp)) > 1:  # a union of sections: each has its own table
            continue
        out.append((f"{prefix}{f.name}", type_name(tp), default_text(default_of(f)), comments.get(f.name, "")))
    return out


def sections(cls: type, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted prefix, class) of the schema and each nested section, in field order."""
    out = [(prefix, cls)]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.extend(sections(tp, f"{prefix}{f.name}."))
        elif typing.get_origin(tp) is list and dataclasses.is_dataclass(item := typing.get_args(tp)[0]):
            out.extend(sections(item, f"{prefix}{f.name}[]."))  # each list item is one of these
        elif dataclasses.is_dataclass(inner := _strip_optional(tp)[0]):
            out.extend(sections(inner, f"{prefix}{f.name}."))  # an optional section: null unless set
        else:  # a union of sections, one per model_type
            for member in dataclass_members(tp):
                out.extend(sections(member, f"{prefix}{f.name}."))
    return out


def all_rows(cls: type) -> list[tuple[str, str, str, str]]:
    """Every key of the schema, list items' keys (``inputs[].kind``) included."""
    out = []
    for prefix, section in sections(cls):
        hints = typing.get_type_hints(section)
        out += [r for r in rows(section, prefix)
                if not dataclasses.is_dataclass(hints.get(r[0][len(prefix):].split(".")[0]))]
    return out


def render(schemas=SCHEMAS) -> str:
    parts = [
        "# Config reference",
        "",
        "<!-- Generated by `python -m bertdist.config.reference > docs/config-reference.md`; do not edit. "
        "tests/config/test_reference.py fails when this file is stale. -->",
        "",
        "Every key of every config schema: its type, its default and the comment the schema gives it.",
        "YAML files are instances of these schemas; `key.path=value` overrides are checked against them",
        "(an unknown key is an error that lists the valid ones). The resolved config is saved with every",
        "run and checkpoint.",
        "",
    ]
    parts += [f"- [{title}](#{title.lower().replace(' ', '-')})" for title, *_ in schemas]
    for title, ref, where, how in schemas:
        cls = load_schema(ref)
        parts += ["", f"## {title}", "", f"Schema `{ref.replace(':', '.')}`; instances: {where}; set a key with {how}.", ""]
        found = sections(cls)
        prefixes = [q for q, _ in found]
        shared = {q for q in prefixes if prefixes.count(q) > 1}
        for prefix, section in found:
            doc = inspect.getdoc(section) if section.__doc__ and not section.__doc__.startswith(section.__name__ + "(") else ""
            name = f"`{prefix.rstrip('.')}`" if prefix else f"`{section.__name__}` (top level)"
            if prefix in shared:  # one of a union's sections: which one
                tag = next((f.default for f in dataclasses.fields(section) if f.name == "model_type"), None)
                name += f" ({section.__name__}" + (f", `model_type: {tag}`)" if tag else ")")
            parts += [f"### {name}", ""]
            if doc:
                parts += [" ".join(doc.split()), ""]
            parts += ["| key | type | default | meaning |", "|---|---|---|---|"]
            hints = typing.get_type_hints(section)
            leaves = [r for r in rows(section, prefix)
                      if not dataclasses.is_dataclass(hints.get(r[0][len(prefix):].split(".")[0]))]
            for key, tp, default, comment in leaves:
                parts.append(f"| `{key}` | {tp} | `{cell(default)}` | {cell(comment)} |")
            parts.append("")
    return "\n".join(parts).rstrip("\n") + "\n"


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
