"""Count the suite's tests and the checks in them that can fail, read with `ast` (nothing is run):
test functions, `assert` statements, and pytest.raises / pytest.fail / pytest.warns calls.

Usage: python3 tests/count_checks.py [DIR]   (default: this tests/ directory)
tests/TIMINGS.md compares the counts before and after a change to the suite.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def count(root: Path) -> dict[str, int]:
    """{"test functions", "assert statements", "pytest.raises/fail/warns"} over root's *.py files."""
    out = dict.fromkeys(("test functions", "assert statements", "pytest.raises/fail/warns"), 0)
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
                out["test functions"] += 1
            elif isinstance(node, ast.Assert):
                out["assert statements"] += 1
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and isinstance(node.func.value, ast.Name) and node.func.value.id == "pytest"
                  and node.func.attr in ("raises", "fail", "warns")):
                out["pytest.raises/fail/warns"] += 1
    return out


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent
    print(", ".join(f"{k} {v}" for k, v in count(root).items()))
