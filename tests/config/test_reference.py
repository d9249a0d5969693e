"""docs/config-reference.md is the output of bertdist.config.reference: current, complete, and made
without torch or Beam."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

from bertdist.config import reference

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "config-reference.md"
REGENERATE = "python -m bertdist.config.reference > docs/config-reference.md"


def test_the_committed_reference_is_current():
    assert DOC.read_text(encoding="utf-8") == reference.render(), \
        f"docs/config-reference.md is stale: run `{REGENERATE}` and commit it"


def test_every_key_of_every_schema_is_listed_with_its_default():
    text = reference.render()
    for _, ref, *_ in reference.SCHEMAS:
        for key, _, default, _ in reference.all_rows(reference.load_schema(ref)):
            assert f"| `{key}` |" in text and f"`{reference.cell(default)}`" in text, key
    assert "| `deepspeed.zero_stage` | int | `1` |" in text
    assert "| `data.masking` | \"auto\" \\| \"static\" \\| \"dynamic\" | `\"auto\"` | auto: dynamic iff the records are unmasked |" in text


def test_comments_come_from_the_source_line_and_the_lines_above():
    @dataclasses.dataclass
    class Example:
        plain: int = 1
        inline: str = "x"  # said on the line
        # said above,
        # over two lines
        above: typing.Optional[float] = None  # and on the line
        listed: list = dataclasses.field(default_factory=lambda: [1, 2])

    comments = reference.field_comments(Example)
    assert comments == {"plain": "", "inline": "said on the line",
                        "above": "said above, over two lines and on the line", "listed": ""}
    assert [r[1:3] for r in reference.rows(Example)] == [("int", "1"), ("str", '"x"'), ("float \\| None", "null"),
                                                         ("list", "[1, 2]")]


def test_made_without_torch_or_beam():
    code = ("import sys; from bertdist.config import reference; reference.render(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'apache_beam', 'deepspeed'}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)
