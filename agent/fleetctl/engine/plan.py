"""Plans: a playbook applied to one host's facts and findings, as plain data, touching nothing.

Input is what inspect returns for a host (facts; findings with `need_sort_origins` etc. and
`files` {rel: {sha256, size}}) and the text of the files those findings point into. Each edit
replaces a finding's value span (1-based lines, 0-based character columns, from the inspect
probe's AST reading) with the task's rendered value and appends the rendered comment at the
first line end after the value (for an assignment the statement's last line, for a keyword its
own line inside the call; tokenize finds it, so backslash continuations stay intact).

A site whose comment line already carries the task's marker, whose value is what the task
writes, and that the task's `when` no longer selects is "already applied"; a marked site that
`when` still selects was changed by hand after the apply, and the host is refused rather than
edited twice.

A create_file task's file has no pre-image (FileChange.pre_sha256 None): one already there with
the rendered text is "already applied", with any other text refused. An insert_text task puts
its rendered text before the line its site names; the site's `present` (what the finding read
there already) equal to that text is "already applied", anything else refused.

Every file the host names (each call site's and finding's `file`, every key of findings["files"]
and of the sources) must be a file of the install (hostpaths.package_file: relative, under sglang/,
no `..`) before it is joined to anything: a host that names another is refused (review N2).
"""

from __future__ import annotations

import ast
import bisect
import difflib
import hashlib
import io
import posixpath
import re
import threading
import tokenize
from dataclasses import asdict, dataclass, field

from ..hostpaths import Refused, package_file
from .playbook import CreateTask, EditTask, InsertTask, Playbook
from ..vocab import PlanStatus


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


@dataclass
class HostPlan:
    """What a playbook would do to one host.

    status: a PlanStatus: change | ok (nothing to do) | skipped (reason "not applicable: ...") |
    failed (refused, e.g. "changed since inspect: <rel>"; nothing may be written).
    edits / already_applied / left_alone: sites as {file, line, kind, callee, expr, ...}.
    handlers: rendered handlers to run after the change [{name, command, wait_for_health_s}].
    validate: validate steps that apply to this host [{step}].
    install: the id of the install planned ("host:<package_dir>"), None when there is none.
    """

    host: str
    playbook: str
    status: PlanStatus
    reason: str | None = None
    files: list[FileChange] = field(default_factory=list)
    edits: list[dict] = field(default_factory=list)
    already_applied: list[dict] = field(default_factory=list)
    left_alone: list[dict] = field(default_factory=list)
    handlers: list[dict] = field(default_factory=list)
    validate: list[dict] = field(default_factory=list)
    install: str | None = None

    def to_dict(self) -> dict:
        """JSON-serialisable form (files include new_text and diff)."""
        return asdict(self)


# ast.parse from several threads at once can fail in CPython 3.11 before 3.11.8 with
# "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905); hosts are
# planned in the fleet's threads, so parsing is serialised.
_AST_LOCK = threading.Lock()


def _parse(source: str, mode: str = "exec") -> ast.AST:
    with _AST_LOCK:
        return ast.parse(source, mode=mode)


class _Refused(Exception):
    """The host's inputs do not allow a safe plan; becomes status "failed"."""


# Every character Python's str.splitlines() breaks at (a lone CR ends a line for the tokenizer
# too): a rendered comment holding one would end the comment and start code (review L5).
_ANY_LINE_BREAK = re.compile("[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")


def sha256_text(text: str) -> str:
    """sha256 hex of the text's UTF-8 bytes (the bytes the change probe reads and writes)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def one_line(expr: str) -> str:
    """A (possibly multi-line) Python expression's source on one line: comments and line breaks
    dropped, tokens kept verbatim, one space where the source had any whitespace."""
    if not _ANY_LINE_BREAK.search(expr) and "#" not in expr:
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


class _Source:
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
        return self.starts[line - 1] + col

    def line_end_after(self, line: int, col: int) -> tuple[int, int]:
        """(row, offset) where a trailing comment goes: the first line end at or after (line, col),
        before the line's trailing whitespace."""
        row, c = self.ends[bisect.bisect_left(self.ends, (line, col))]
        off = self.offset(row, c)
        while off > 0 and self.text[off - 1] in " \t\r":
            off -= 1
        return row, off


def _site(f: dict, **extra) -> dict:
    return {"file": f["file"], "line": f["line"], "kind": f.get("kind"), "callee": f.get("callee"),
            "expr": f["expr"], "value_line": f.get("value_line"), "value_col": f.get("value_col"), **extra}


def _render_handlers(playbook: Playbook, names: list[str], ctx: dict) -> list[dict]:
    out = []
    for name in dict.fromkeys(names):
        h = playbook.handlers[name]
        if h.when is None or h.when(ctx):
            out.append({"name": name, "command": h.command.render(ctx), "wait_for_health_s": h.wait_for_health_s})
    return out


def plan_host(playbook: Playbook, host_name: str, host_vars: dict, facts: dict, findings: dict,
              sources: dict[str, str]) -> HostPlan:
    """Plan `playbook` for one host from its inspect results; reads and writes nothing.

    Args: host_vars: the host's inventory vars; facts: inspect facts (sglang.location is the
    site-packages dir the finding files are relative to); findings: inspect findings incl.
    "files" {rel: {"sha256"}}; sources: {rel: text} of every file a selected finding is in,
    exactly as read from the host (its UTF-8 sha256 must equal findings["files"][rel]["sha256"]).
    Returns a HostPlan; refusals (a file named outside the install: "refused a path from the
    host: '../x' (not relative to the install)", see hostpaths.package_file; source changed since
    inspect or not UTF-8, findings that do not match the source, a new text that does not parse)
    are status "failed" with the reason, and no files.
    Raises ParseError for template and expression errors (undefined variables included).
    """
    ctx = {**host_vars, "host": host_name, "facts": facts, "findings": findings}
    plan = HostPlan(host_name, playbook.name, PlanStatus.OK)
    for req in playbook.requires:
        if not req.that(ctx):
            if req.refuse:
                plan.status, plan.reason = PlanStatus.FAILED, f"refused: {req.reason.render(ctx)}"
            else:
                plan.status, plan.reason = PlanStatus.SKIPPED, f"not applicable: {req.reason.render(ctx)}"
            return plan
    try:
        edits = _plan_edits(playbook, plan, ctx, facts, findings, sources)
    except (_Refused, Refused) as e:
        plan.status, plan.reason = PlanStatus.FAILED, str(e)
        return plan
    if edits:
        plan.status = PlanStatus.CHANGE
        plan.handlers = _render_handlers(playbook, [h for t in edits for h in t.notify], ctx)
        plan.validate = [{"step": v.step, **({"offline": v.offline.render(ctx)} if v.offline else {})}
                         for v in playbook.validate if v.when is None or v.when(ctx)]
    return plan


def _plan_edits(playbook, plan, ctx, facts, findings, sources) -> list[EditTask]:
    """Fill plan.files/edits/already_applied/left_alone; return the tasks that changed something."""
    location = ((facts or {}).get("sglang") or {}).get("location")
    if not location:
        raise _Refused("no sglang location in facts")
    sites = [f["file"] for key in ("allocator_call_sites", "need_sort_origins") for f in findings.get(key) or []]
    for rel in [*sites, *(findings.get("files") or {}), *sources]:
        package_file(rel)
    per_file: dict[str, list] = {}  # rel -> [(start, end, replacement)]
    comments: dict[str, dict[int, list[str]]] = {}  # rel -> {offset: [comment, ...]}
    srcs: dict[str, _Source] = {}
    changed_tasks = []
    created: list[FileChange] = []
    for task in playbook.tasks:
        if isinstance(task, CreateTask):
            if _plan_create(task, plan, ctx, location, findings, sources, created):
                changed_tasks.append(task)
            continue
        if isinstance(task, InsertTask):
            if _plan_insert(task, plan, ctx, findings, sources, srcs, per_file):
                changed_tasks.append(task)
            continue
        changed = False
        for f in findings.get(task.findings) or []:
            rel = package_file(f["file"])  # a playbook's task may name any findings list
            fctx = {**ctx, "finding": {**f, "expr_one_line": one_line(f["expr"])}}
            src = srcs.get(rel) or srcs.setdefault(rel, _checked_source(rel, findings, sources))
            start = src.offset(f["value_line"], f["value_col"])
            end = src.offset(f["value_end_line"], f["value_end_col"])
            if src.text[start:end] != f["expr"]:
                raise _Refused(f"findings do not match the source at {rel}:{f['line']}")
            row, at = src.line_end_after(f["value_end_line"], f["value_end_col"])
            marked = task.marker in src.comments.get(row, "")
            selected = bool(task.when(fctx))
            if marked and selected:
                raise _Refused(f"{rel}:{f['line']} carries {task.marker!r} but its value was changed since")
            if marked and f["expr"] == task.value.render(fctx):
                # the site itself holds what the task writes (another finding on the same marked
                # line, say a nested literal, is left alone below)
                plan.already_applied.append(_site(f, task=task.name))
                continue
            if not selected:
                plan.left_alone.append(_site(f, literal=f.get("literal")))
                continue
            value, comment = task.value.render(fctx), task.comment.render(fctx)
            try:
                _parse(value, mode="eval")
            except SyntaxError:
                raise _Refused(f"{task.value.template.filename} renders {value!r}, not a Python expression") from None
            if _ANY_LINE_BREAK.search(comment) or not comment.startswith("#") or task.marker not in comment:
                raise _Refused(f"{task.comment.template.filename} must render one '#' line holding {task.marker!r}")
            per_file.setdefault(rel, []).append((start, end, value))
            comments.setdefault(rel, {}).setdefault(at, []).append(comment)
            plan.edits.append(_site(f, old_expr=f["expr"], new_expr=value, task=task.name))
            changed = True
        if changed:
            changed_tasks.append(task)
    plan.files += created  # first: the change probe writes in this order, so an edit importing a new file
    for rel, spans in per_file.items():  # (triton_backend.py's import of fleetctl_verify) never runs before it
        plan.files.append(_edit_file(rel, posixpath.join(location, rel), srcs[rel].text, spans, comments.get(rel, {})))
    return changed_tasks


def _plan_create(task: CreateTask, plan: HostPlan, ctx: dict, location: str, findings: dict,
                 sources: dict[str, str], created: list[FileChange]) -> bool:
    """Plan a CreateTask: a FileChange with pre_sha256 None into `created` (True), or the file
    already there with exactly the rendered text (already applied, False). Refused: a path
    outside the install, a file there with other text, a .py text that does not parse."""
    rel = package_file(task.path.render(ctx))
    text = task.template.render(ctx, strip=False)
    text = text if text.endswith("\n") else text + "\n"
    site = {"file": rel, "line": 1, "kind": "create", "task": task.name}
    if rel in (findings.get("files") or {}):
        if _checked_source(rel, findings, sources).text != text:
            raise _Refused(f"{rel} exists and is not what {task.template.template.filename} renders: not "
                           "replacing a file this playbook did not write (roll back the change that wrote it)")
        plan.already_applied.append(site)
        return False
    if rel.endswith(".py"):
        try:
            _parse(text)
        except SyntaxError as e:
            raise _Refused(f"{task.template.template.filename} renders a {rel} that does not parse: line "
                           f"{e.lineno}: {e.msg}") from None
    diff = "".join(difflib.unified_diff([], text.splitlines(True), "/dev/null", f"b/{rel}"))
    created.append(FileChange(rel, posixpath.join(location, rel), None, sha256_text(text), text, diff))
    plan.edits.append(dict(site, new_sha256=sha256_text(text)))
    return True


def _plan_insert(task: InsertTask, plan: HostPlan, ctx: dict, findings: dict, sources: dict[str, str],
                 srcs: dict, per_file: dict) -> bool:
    """Plan an InsertTask at the site its expression gives ({file, line, present}): an insertion
    span into `per_file` (True), or, when the site's `present` text is the rendered one, already
    applied (False). Refused: no site, a present text that differs, a rendered text without the
    marker."""
    site = task.site(ctx)
    if not isinstance(site, dict) or not site.get("file") or not isinstance(site.get("line"), int):
        raise _Refused(f"{task.site.where}: {task.site.source!r} gives no site to insert at")
    rel = package_file(site["file"])
    text = task.template.render({**ctx, "site": site}, strip=False)
    text = text if text.endswith("\n") else text + "\n"
    if task.marker not in text:
        raise _Refused(f"{task.template.template.filename} must render text holding {task.marker!r}")
    entry = {"file": rel, "line": site["line"], "kind": "insert", "task": task.name}
    if site.get("present") is not None:
        if site["present"] != text:
            raise _Refused(f"{rel}:{site['line']} carries {task.marker!r} but not the text this playbook renders "
                           "(changed by hand, or by another release of the playbook): roll that back first")
        plan.already_applied.append(entry)
        return False
    src = srcs.get(rel) or srcs.setdefault(rel, _checked_source(rel, findings, sources))
    indent = site.get("indent", "")
    if not isinstance(indent, str) or indent.strip(" \t") or (site["line"], len(indent)) not in _statement_starts(src):
        raise _Refused(f"{rel}:{site['line']}: the site {task.site.source!r} gives (indent {indent!r}) is not where a "
                       "statement of the source starts: the findings do not match the source")
    at = src.offset(site["line"], 0)
    per_file.setdefault(rel, []).append((at, at, text))
    plan.edits.append(dict(entry, new_text=text))
    return True


def _statement_starts(src: _Source) -> set[tuple[int, int]]:
    """{(line, column)} (1-based line, column in characters) where a statement of `src` starts,
    a decorated definition at its first decorator's line; what an insertion site must be."""
    starts = set()
    for node in ast.walk(_parse(src.text)):
        if isinstance(node, ast.stmt):
            line = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            head = src.text[src.starts[node.lineno - 1]:]
            col = len(head.encode("utf-8")[:node.col_offset].decode("utf-8", "replace"))
            starts.add((line, col))
    return starts


def _checked_source(rel: str, findings: dict, sources: dict[str, str]) -> _Source:
    if rel not in sources:
        raise _Refused(f"no source text for {rel}")
    if sources[rel] is None:
        raise _Refused(f"{rel} is not UTF-8 text")
    want = ((findings.get("files") or {}).get(rel) or {}).get("sha256")
    if sha256_text(sources[rel]) != want:
        raise _Refused(f"changed since inspect: {rel}")
    return _Source(sources[rel])


def _edit_file(rel: str, path: str, text: str, spans: list, comments: dict[int, list[str]]) -> FileChange:
    pieces = sorted(spans + [(at, at, "  " + "  ".join(cs)) for at, cs in comments.items()])
    out, pos = [], 0
    for start, end, new in pieces:
        if start < pos:
            raise _Refused(f"overlapping edits in {rel}")
        out += [text[pos:start], new]
        pos = end
    new_text = "".join(out) + text[pos:]
    try:
        _parse(new_text)
    except SyntaxError as e:
        raise _Refused(f"the edited {rel} does not parse: line {e.lineno}: {e.msg}") from None
    diff = "".join(difflib.unified_diff(text.splitlines(True), new_text.splitlines(True), f"a/{rel}", f"b/{rel}"))
    return FileChange(rel, path, sha256_text(text), sha256_text(new_text), new_text, diff)


def reinspect_problems(playbook: Playbook, plan: HostPlan, host_vars: dict, facts: dict, findings: dict,
                       sources: dict[str, str]) -> list[str]:
    """Validation after apply, from a fresh inspect of the host: [] when the change took.

    Replans on the fresh findings/sources: the result must be status "ok" (nothing left to edit),
    every file of `plan` must now have its post_sha256, and every already-applied site must
    satisfy the playbook's reinspect `that` expression. Returns the problems as messages.
    """
    problems = []
    for fc in plan.files:
        got = ((findings.get("files") or {}).get(fc.rel) or {}).get("sha256")
        if got != fc.post_sha256:
            problems.append(f"{fc.rel}: sha256 {str(got)[:12]} is not the planned {fc.post_sha256[:12]}")
    again = plan_host(playbook, plan.host, host_vars, facts, findings, sources)
    if again.status != PlanStatus.OK:
        problems.append(f"replanning gives {again.status}: "
                        + (again.reason or f"{len(again.edits)} sites still to edit"))
    if len(again.already_applied) < len(plan.edits):
        problems.append(f"{len(again.already_applied)} sites carry the change, {len(plan.edits)} were edited")
    ctx = {**host_vars, "host": plan.host, "facts": facts, "findings": findings}
    checks = [v.that for v in playbook.validate if v.step == "reinspect" and v.that is not None]
    # exactly the sites that carry the change (another finding on the same line, say a nested
    # literal need_sort=False, is not one of them)
    applied = {(a["file"], a.get("value_line"), a.get("value_col")) for a in again.already_applied
               if a.get("kind") not in ("create", "insert")}
    for task in (t for t in playbook.tasks if isinstance(t, EditTask)):
        for f in findings.get(task.findings) or []:
            if (f["file"], f.get("value_line"), f.get("value_col")) in applied:
                fctx = {**ctx, "finding": {**f, "expr_one_line": one_line(f["expr"])}}
                problems += [f"{f['file']}:{f['line']}: {f['expr']!r} fails {c.source!r}" for c in checks
                             if not c(fctx)]
    return problems
