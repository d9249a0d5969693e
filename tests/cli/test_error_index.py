"""docs/troubleshooting.md ends with the index bertdist.cli.error_index makes from the source's
raises: current, and complete for messages written as literals."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from bertdist.cli import error_index

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "troubleshooting.md"
REGENERATE = "python -m bertdist.cli.error_index --write docs/troubleshooting.md"


def test_the_page_holds_the_current_index():
    page = PAGE.read_text(encoding="utf-8")
    assert error_index.BEGIN in page and error_index.END in page
    assert error_index.splice(page, error_index.render_section()) == page, \
        f"docs/troubleshooting.md's error index is stale: run `{REGENERATE}` and commit it"


def test_every_literal_raise_is_listed():
    """Cross-check with a plain text search: each `raise X("...` / `raise X(f"...` line of the
    packages has its message's first words in the index."""
    section = error_index.render_section()
    missed = []
    for package in error_index.PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            for m in re.finditer(r"raise \w+\(\s*f?\"([^\"{\\]{12,})", path.read_text(encoding="utf-8")):
                words = " ".join(m.group(1).split())
                if words not in section:
                    missed.append(f"{path.relative_to(REPO)}: {words}")
    assert not missed, "\n".join(missed)
    assert len(error_index.all_errors()) > 200


def test_templates_keep_the_text_and_name_the_values():
    call = ast.parse('raise ValueError(f"--nodes must be >= 1, got {self.nodes}" + " (see --help)")').body[0].exc
    assert error_index.template(call.args[0]) == "--nodes must be >= 1, got {self.nodes} (see --help)"
    assert error_index.template(ast.parse("msg").body[0].value) is None  # not a literal: not listed


def test_splice_replaces_only_the_generated_section():
    page = f"# T\n\nhand-written\n\n{error_index.BEGIN}\nold\n{error_index.END}\n\nafter\n"
    out = error_index.splice(page, f"{error_index.BEGIN}\nnew\n{error_index.END}\n")
    assert out == f"# T\n\nhand-written\n\n{error_index.BEGIN}\nnew\n{error_index.END}\n\nafter\n"
