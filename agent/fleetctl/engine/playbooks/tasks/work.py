"""What a task's planner works with: the host's planning state (`Work`), the install's files as the
plan reads them (`Source`, checked against inspect's sha256), and the file changes it makes.

Every file a planner joins to anything is a file of the install (hostpaths.package_file). A
planner that finds the host's inputs do not allow a safe plan raises PlanRefused: the host's plan
is then status "failed" with its message, and no files.
"""

from __future__ import annotations

import ast
import hashlib
import io
import re
import threading
import tokenize
from bisect import bisect_left
from dataclasses import dataclass, field


@dataclass
class FileChange:
    """One file's edit: `path` is absolute on the host (location/rel); sha256 in hex of UTF-8
    bytes; pre_sha256 None: the change creates the file (the change probe refuses one that exists)."""

    rel: str
    path: str
    pre_sha256: str | None
    post_sha256: str
    new_text: str
    diff: str


class PlanRefused(Exception):
    """The host's inputs do not allow a safe plan; becomes status "failed"."""


# ast.parse from several threads at once can fail in CPython 3.11 before 3.11.8 with
# "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905); hosts are
# planned in the fleet's threads, so parsing is serialised.
_AST_LOCK = threading.Lock()


def parse_python(source: str, mode: str = "exec") -> ast.AST:
    """ast.parse(source, mode), one thread at a time. Raises SyntaxError."""
    with _AST_LOCK:
        return ast.parse(source, mode=mode)


# Every character Python's str.splitlines() breaks at (a lone CR ends a line for the tokenizer
# too): a rendered comment holding one would end the comment and start code (review L5).
ANY_LINE_BREAK = re.compile("[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")


def sha256_text(text: str) -> str:
    """sha256 hex of the text's UTF-8 bytes (the bytes the change probe reads and writes)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def one_line(expr: str) -> str:
    """A (possibly multi-line) Python expression's source on one line: comments and line breaks
    dropped, tokens kept verbatim, one space where the source had any whitespace."""
    if not ANY_LINE_BREAK.search(expr) and "#" not in expr:
        return expr.strip()
    out, prev = [], None
    for tok in tokenize.generate_tokens(io.StringIO("(" + expr + "\n)").readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                        tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        if prev is not None and tok.start != prev.end and prev.string not in "([{" \
                and tok.string not in ")]},":
            out.append(" ")
        out.append(tok.string)
        prev = tok
    return "".join(out[1:-1]).strip()


_LINE_BREAK = re.compile(r"\r\n|\r|\n")


class Source:
    """One file's text with character offsets, line ends and comments from tokenize."""

    def __init__(self, text: str):
        self.text = text
        self.starts = [0] + [m.end() for m in _LINE_BREAK.finditer(text)]  # line breaks as ast counts them
        self.ends: list[tuple[int, int]] = []  # (row, col) of each NEWLINE / NL token
        self.comments: dict[int, str] = {}
        for tok in tokenize.generate_tokens(io.StringIO(text, newline=None).readline):
            if tok.type in (tokenize.NEWLINE, tokenize.NL):
                self.ends.append(tok.start)
            elif tok.type == tokenize.COMMENT:
                self.comments[tok.start[0]] = tok.string

    def offset(self, line: int, col: int) -> int:
        """The character offset of (1-based line, 0-based character column)."""
        return self.starts[line - 1] + col

    def line_end_after(self, line: int, col: int) -> tuple[int, int]:
        """(row, offset) where a trailing comment goes: the first line end at or after (line, col),
        before the line's trailing whitespace."""
        row, c = self.ends[bisect_left(self.ends, (line, col))]
        off = self.offset(row, c)
        while off > 0 and self.text[off - 1] in " \t\r":
            off -= 1
        return row, off


def checked_source(rel: str, findings: dict, sources: dict[str, str]) -> Source:
    """The Source of `rel` from `sources` ({rel: text, None: not UTF-8}), whose sha256 must be
    inspect's (findings["files"][rel]["sha256"]). Raises PlanRefused: no text, not UTF-8, or
    "changed since inspect: REL"."""
    if rel not in sources:
        raise PlanRefused(f"no source text for {rel}")
    if sources[rel] is None:
        raise PlanRefused(f"{rel} is not UTF-8 text")
    want = ((findings.get("files") or {}).get(rel) or {}).get("sha256")
    if sha256_text(sources[rel]) != want:
        raise PlanRefused(f"changed since inspect: {rel}")
    return Source(sources[rel])


@dataclass
class Work:
    """One host's planning, as each task's `plan` fills it. `ctx`: the render context (the host's
    vars, host, facts, findings); `location`: the install's site-packages dir on the host;
    `findings` and `sources` as plan.plan_host takes them. A planner adds sites to the plan's
    `edits` / `already_applied` / `left_alone` lists (dicts, HostPlan's), new files to `created`,
    and changes to existing files as `per_file` {rel: [(start, end, text)]} character spans
    (start == end: an insertion) and `comments` {rel: {offset: [comment]}}; `srcs` caches the
    Sources it read."""

    ctx: dict
    location: str
    findings: dict
    sources: dict[str, str]
    edits: list[dict]
    already_applied: list[dict]
    left_alone: list[dict]
    created: list[FileChange] = field(default_factory=list)
    per_file: dict[str, list] = field(default_factory=dict)
    comments: dict[str, dict[int, list[str]]] = field(default_factory=dict)
    srcs: dict[str, Source] = field(default_factory=dict)

    def source(self, rel: str) -> Source:
        """checked_source of `rel`, read once."""
        return self.srcs.get(rel) or self.srcs.setdefault(rel, checked_source(rel, self.findings, self.sources))
