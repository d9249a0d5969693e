"""Loading the job templates in cluster/templates/.

Placeholders are ``@@{name}`` (not ``$name``: the templates are bash, full of ``$``).
Every placeholder must be filled; a missing or unused value is an error, so a
template and its renderer cannot drift apart silently.
"""
from __future__ import annotations

import string
from pathlib import Path

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"


class _AtTemplate(string.Template):
    delimiter = "@@"


def render_template(name: str, **values: str) -> str:
    text = (TEMPLATE_DIR / name).read_text()
    tpl = _AtTemplate(text)
    wanted = {m.group("braced") or m.group("named") for m in tpl.pattern.finditer(text) if m.group("braced") or m.group("named")}
    missing = wanted - set(values)
    unused = set(values) - wanted
    if missing or unused:
        raise KeyError(f"template {name}: missing values {sorted(missing)}, unused values {sorted(unused)}")
    return tpl.substitute(values)
