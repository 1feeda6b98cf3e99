"""Second readings the tests hold fleetctl against, shared by the rooms (tests/unit, tests/fleet,
tests/machine): plain `ast` readings of allocator call sites and need_sort origins, written apart
from probes/facts/callsites.py (the latter in the inspect probe's JSON shape, so the planner is tested
without the probe), a strict unified-diff applier (a reversed diff cannot apply), and files of
real SGLang releases from the wheel cache."""

from __future__ import annotations

import ast
import hashlib
import re
import warnings
import zipfile
from pathlib import Path

from fleetctl.wheels import ensure_wheel


SUFFIX = "TokenToKVPoolAllocator"


def independent(location: Path):
    """Plain second reading: (direct call sites, aliased call sites, origins) as (file, line) sets."""
    direct, aliased, origins = set(), set(), set()
    for p in sorted((location / "sglang").rglob("*.py")):
        rel = p.relative_to(location).as_posix()
        if {"test", "tests"} & set(rel.split("/")[:-1]):
            continue
        data = p.read_bytes()
        # every result below is a node of this file whose text names SUFFIX or need_sort (in ASCII,
        # as SGLang spells them): a file naming neither has none and is not parsed (0.5.23 has 4,024)
        if SUFFIX.encode() not in data and b"need_sort" not in data:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in sglang sources
            tree = ast.parse(data)
        alias_names, name_calls = set(), []
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", "")
                if name.endswith(SUFFIX):
                    direct.add((rel, node.lineno))
                elif isinstance(node.func, ast.Name):
                    name_calls.append((name, node.lineno))
                for k in node.keywords:
                    if k.arg == "need_sort" and not isinstance(k.value, ast.Name):
                        origins.add((rel, k.value.lineno))
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                parts = node.value.values if isinstance(node.value, ast.BoolOp) else (
                    [node.value.body, node.value.orelse] if isinstance(node.value, ast.IfExp) else [node.value])
                if any(getattr(x, "id", getattr(x, "attr", "")).endswith(SUFFIX) for x in parts):
                    alias_names.add(node.targets[0].id)
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value else [])
            if any(isinstance(t, ast.Name) and t.id == "need_sort" for t in targets):
                origins.add((rel, node.lineno))
        aliased |= {(rel, line) for name, line in name_calls if name in alias_names}
    return direct, aliased, origins


_HUNK = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@\n")


def apply_diff(old: str, diff: str, rel: str) -> str:
    """Apply unified diff `diff` to `old` as `patch` would, strictly: the headers name a/rel and
    b/rel, every hunk starts where its header says, and every context and removed line must be
    exactly the old text's line there. So a reversed diff (old and new swapped) cannot apply."""
    lines = diff.splitlines(True)
    assert lines[:2] == [f"--- a/{rel}\n", f"+++ b/{rel}\n"], lines[:2]
    src, out, pos, i = old.splitlines(True), [], 0, 2
    while i < len(lines):
        m = _HUNK.fullmatch(lines[i])
        assert m, f"not a hunk header: {lines[i]!r}"
        old_len, new_len = int(m[2] or 1), int(m[4] or 1)
        start = int(m[1]) - (1 if old_len else 0)  # an empty range names the line before it
        assert start >= pos, "hunks out of order"
        out += src[pos:start]
        pos = start
        assert len(out) == int(m[3]) - (1 if new_len else 0), "hunk starts elsewhere in the new text"
        i, removed, added = i + 1, 0, 0
        while i < len(lines) and not lines[i].startswith("@@ "):
            tag, body = lines[i][0], lines[i][1:]
            assert tag in " -+", lines[i]
            if tag in " -":
                assert pos < len(src) and src[pos] == body, f"line {pos + 1}: {body!r} is not {src[pos:pos + 1]}"
                pos, removed = pos + 1, removed + 1
            if tag in " +":
                out.append(body)
                added += 1
            i += 1
        assert (removed, added) == (old_len, new_len), "hunk line counts"
    return "".join(out + src[pos:])


PLAYBOOK = Path(__file__).resolve().parents[1] / "playbooks" / "defrag-tier0.yaml"


def _col(line: str, byte_col: int) -> int:
    return len(line.encode("utf-8")[:byte_col].decode("utf-8"))


def scan_text(rel: str, text: str) -> list[dict]:
    """need_sort origins of one file, in the inspect probe's shape (character columns)."""
    lines = text.split("\n")
    out = []
    for node in ast.walk(ast.parse(text)):
        sites = []
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name) and t.id == "need_sort":  # `self.need_sort = x` only stores it
                    sites.append(("assignment", node.lineno, None, ast.get_source_segment(text, t), node.value))
        elif isinstance(node, ast.Call):
            for k in node.keywords:
                if k.arg == "need_sort" and not isinstance(k.value, ast.Name):
                    callee = ast.get_source_segment(text, node.func).split(".")[-1]
                    sites.append(("keyword", k.value.lineno, callee, "need_sort", k.value))
        for kind, line, callee, target, v in sites:
            stmt_end = node.end_lineno
            out.append({
                "file": rel, "line": line, "kind": kind, "callee": callee, "target": target,
                "expr": ast.get_source_segment(text, v), "literal": isinstance(v, ast.Constant),
                "value_line": v.lineno, "value_col": _col(lines[v.lineno - 1], v.col_offset),
                "value_end_line": v.end_lineno, "value_end_col": _col(lines[v.end_lineno - 1], v.end_col_offset),
                "stmt_end_line": stmt_end})
    return sorted(out, key=lambda f: f["line"])


def host_inputs(files: dict[str, str], location: str = "/opt/venv/lib/python3.11/site-packages"):
    """(facts, findings, sources) for a host whose sglang files are `files` {rel: text}."""
    origins, sources, hashes = [], {}, {}
    for rel, text in sorted(files.items()):
        found = scan_text(rel, text)
        origins += found
        hashes[rel] = {"sha256": hashlib.sha256(text.encode()).hexdigest(), "size": len(text.encode())}
        if found:
            sources[rel] = text
    facts = {"hostname": "h", "python": {"path": "/usr/bin/python3", "version": "3.11"},
             "sglang": {"version": "x", "location": location}, "servers": []}
    return facts, {"allocator_call_sites": [], "need_sort_origins": origins, "files": hashes}, sources


def release_file(version: str, rel: str) -> str:
    """The text of one file of the release's wheel (without reading the whole wheel)."""
    with zipfile.ZipFile(ensure_wheel(version)) as z:
        return z.read(rel).decode()
