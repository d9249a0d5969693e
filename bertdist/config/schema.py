"""Dataclasses as the config schema, YAML files as instances.

Every component defines its own dataclass and receives only that sub-config.
This module holds the generic machinery: building a (nested) dataclass from a
plain dict with strict key checking, applying dotted CLI overrides such as
``model.hidden_size=256`` (unknown keys are rejected, listing the valid ones),
and saving the resolved config as YAML next to a run or checkpoint.
"""
from __future__ import annotations

import dataclasses
import math
import os
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config that does not fit its schema; the message names the key and the allowed values."""


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def dataclass_members(tp: Any) -> tuple[type, ...]:
    """The dataclasses a field of type ``tp`` holds: one for a (optional) section, several for a
    union of sections (``BertConfig | ModernBertConfig``), none for a leaf value."""
    tp, _ = _strip_optional(tp)
    if dataclasses.is_dataclass(tp):
        return (tp,)
    if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        members = tuple(a for a in typing.get_args(tp) if a is not type(None))
        if members and all(dataclasses.is_dataclass(a) for a in members):
            return members
    return ()


def union_member(members: tuple[type, ...], value: Mapping[str, Any], where: str) -> type:
    """The member of a union of sections that ``value`` describes: the one whose ``model_type``
    default is ``value["model_type"]``; the member without a ``model_type`` field when it has none."""
    tag = value.get("model_type")
    for cls in members:
        default = next((f.default for f in dataclasses.fields(cls) if f.name == "model_type"), None)
        if default == tag:
            return cls
    known = [next((f.default for f in dataclasses.fields(c) if f.name == "model_type"), None) for c in members]
    tags = sorted(t for t in known if t is not None)
    default = f", or leave it out for a {members[known.index(None)].__name__}" if None in known else ""
    raise ConfigError(f"{where}.model_type: {tag!r} is not one of {tags}{default}")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert a YAML/CLI value to the declared field type, or raise ConfigError."""
    tp, optional = _strip_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}: null is not allowed (expected {getattr(tp, '__name__', tp)})")
    members = dataclass_members(tp)
    if len(members) > 1:  # a union of sections, told apart by model_type
        if isinstance(value, members):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__} {value!r}")
        tp = union_member(members, value, where)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping for {tp.__name__}, got {type(value).__name__} {value!r}")
        return from_dict(tp, value, _where=where)
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not one of {list(allowed)}")
        return value
    if origin in (list, tuple, Sequence):
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v != ""]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        items = [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: expected a boolean, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        # NaN and infinity pass every comparison-based check silently (lr=nan trains to NaN).
        if not math.isfinite(number):
            raise ConfigError(f"{where}: {value!r} is not a finite number")
        return number
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


def from_dict(cls: type[T], data: Mapping[str, Any], _where: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys are an error that lists the known ones."""
    types = _field_types(cls)
    unknown = sorted(set(data) - set(types))
    if unknown:
        prefix = f"{_where}." if _where else ""
        raise ConfigError(
            f"unknown key(s) {[prefix + k for k in unknown]} for {cls.__name__}; "
            f"valid keys: {sorted(types)}"
        )
    kwargs = {}
    for name, value in data.items():
        where = f"{_where}.{name}" if _where else name
        kwargs[name] = _coerce(value, types[name], where)
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{_where or cls.__name__}: {e}") from None
    return obj


def to_dict(obj: Any) -> Any:
    """Plain-dict view of a dataclass tree (tuples become lists, for YAML)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _parse_scalar(text: str) -> Any:
    # YAML's own scalar rules: "3" -> 3, "1e-4" -> 0.0001, "true" -> True, "[1,2]" -> list.
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(cls: type[T], data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to ``data`` (a dict for ``cls``), validating each path. In a
    union of sections the keys are checked against the member its ``model_type`` names (the
    ``...model_type=`` overrides are applied first, so their order does not matter)."""
    data = _deepcopy(data)
    tags = [o for o in overrides if "=" in o and o.split("=", 1)[0].strip().endswith(".model_type")]
    for item in [*tags, *(o for o in overrides if o not in tags)]:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        path, raw = item.split("=", 1)
        keys = path.strip().split(".")
        node_cls: Any = cls
        node = data
        for depth, key in enumerate(keys):
            types = _field_types(node_cls)
            if key not in types:
                done = ".".join(keys[:depth]) or "<root>"
                raise ConfigError(
                    f"override {item!r}: unknown key {key!r} under {done}; valid keys: {sorted(types)}"
                )
            members = dataclass_members(types[key])
            if depth == len(keys) - 1:
                node[key] = _parse_scalar(raw)
            else:
                if not members:
                    raise ConfigError(f"override {item!r}: {key!r} is a leaf value, not a section")
                if dataclasses.is_dataclass(node.get(key)):
                    node[key] = to_dict(node[key])
                node = node.setdefault(key, {})
                if len(members) > 1 and keys[depth + 1:] == ["model_type"]:  # this override picks the member
                    node_cls = union_member(members, {"model_type": _parse_scalar(raw)}, ".".join(keys[:depth + 1]))
                else:
                    node_cls = members[0] if len(members) == 1 else union_member(members, node,
                                                                                 ".".join(keys[:depth + 1]))
    return data


def _deepcopy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deepcopy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deepcopy(v) for v in d]
    return d


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        with p.open(encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {' '.join(str(e).split())}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {e.start}): is this a config file?") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping, got {type(data).__name__}")
    return data


def load_config(cls: type[T], path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> T:
    """Schema ``cls`` + optional YAML instance at ``path`` + dotted overrides -> validated config."""
    data = load_yaml(path) if path is not None else {}
    data = apply_overrides(cls, data, overrides)
    return from_dict(cls, data)


def save_config(obj: Any, path: str | os.PathLike) -> Path:
    """Write the resolved config as YAML (atomically: tmp file + rename)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    with tmp.open("w") as f:
        yaml.safe_dump(to_dict(obj), f, sort_keys=False)
    os.replace(tmp, p)
    return p
