"""The recorded fact cases, tests/unit/probes/<fact>/<case>.json, as pyinfra keeps its facts'
(tests/facts/<module>.<Fact>/<case>.json): what a host said (a command's output, a /proc file)
and the fact the probe reads from it. tests/unit/test_fact_fixtures.py checks every case; the
tests of what else a probe does take a case's recorded input from here rather than a copy of it.

A case is a JSON object: `about` (what it records, and where it was recorded or laid out from),
the input its fact reads (see test_fact_fixtures.FACTS), and `fact`. A recorded output is a list
of its records: text as its lines (each ends in "\\n"), /proc/PID/cmdline and environ as their
items (each ends in NUL), so that a case reads as the output did. Adding a case is adding a file.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "unit" / "probes"


def cases(fact: str) -> list[str]:
    """The names of `fact`'s cases (file names without .json), sorted."""
    return sorted(p.stem for p in (ROOT / fact).glob("*.json"))


def case(fact: str, name: str) -> dict:
    """The case `name` of `fact`."""
    return json.loads((ROOT / fact / f"{name}.json").read_text())


def text(lines: list[str]) -> str:
    """The text a recorded list of lines is."""
    return "".join(line + "\n" for line in lines)


def items(values: list[str]) -> bytes:
    """The bytes of a recorded list of NUL-terminated items (/proc/PID/cmdline, environ)."""
    return b"".join(v.encode("utf-8") + b"\0" for v in values)
