"""The site's runnable examples (docs/examples/*.t, run against a lab by
tests/fleet/test_docs_examples.py): enough of them, each saying in prose what it shows, each on
the Examples page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.t"))


def test_the_examples_are_enough_and_each_is_on_the_page_saying_what_it_shows():
    commands = sum(len(re.findall(r"^  \$ ", t.read_text(encoding="utf-8"), re.M)) for t in EXAMPLES)
    assert len(EXAMPLES) >= 6 and commands >= 15, (len(EXAMPLES), commands)
    page = (ROOT / "docs" / "examples.md").read_text(encoding="utf-8")
    for t in EXAMPLES:
        assert not t.read_text(encoding="utf-8").startswith("  "), f"{t.name}: say in prose what the example shows"
        assert f'--8<-- "docs/examples/{t.name}"' in page, f"{t.name} is not on the Examples page"
