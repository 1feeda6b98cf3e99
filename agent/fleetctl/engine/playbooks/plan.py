"""Plans: a playbook applied to one host's facts and findings, as plain data, touching nothing.

Input is what inspect returns for a host (facts; findings with `need_sort_origins` etc. and
`files` {rel: {sha256, size}}) and the text of the files those findings point into. Each task
plans itself (its kind's module under engine/tasks: what an edit, a created file or an insertion
is, and when it is "already applied" or refused) into one Work; the spans of each file are then
applied at once, and the edited file must still parse.

Every file the host names (each call site's and finding's `file`, every key of findings["files"]
and of the sources) must be a file of the install (hostpaths.package_file: relative, under sglang/,
no `..`) before it is joined to anything: a host that names another is refused (review N2).
"""

from __future__ import annotations

import difflib
import posixpath
from dataclasses import asdict, dataclass, field

from ...hostpaths import Refused, package_file
from .model import Playbook
from .tasks.work import FileChange, PlanRefused, Work, one_line, parse_python, sha256_text
from ...vocab import PlanStatus


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
        edits = _plan_tasks(playbook, plan, ctx, facts, findings, sources)
    except (PlanRefused, Refused) as e:
        plan.status, plan.reason = PlanStatus.FAILED, str(e)
        return plan
    if edits:
        plan.status = PlanStatus.CHANGE
        plan.handlers = _render_handlers(playbook, [h for t in edits for h in t.notify], ctx)
        plan.validate = [{"step": v.step, **({"offline": v.offline.render(ctx)} if v.offline else {})}
                         for v in playbook.validate if v.when is None or v.when(ctx)]
    return plan


def _plan_tasks(playbook, plan, ctx, facts, findings, sources) -> list:
    """Fill plan.files/edits/already_applied/left_alone; return the tasks that changed something."""
    location = ((facts or {}).get("sglang") or {}).get("location")
    if not location:
        raise PlanRefused("no sglang location in facts")
    sites = [f["file"] for key in ("allocator_call_sites", "need_sort_origins") for f in findings.get(key) or []]
    for rel in [*sites, *(findings.get("files") or {}), *sources]:
        package_file(rel)
    work = Work(ctx, location, findings, sources, plan.edits, plan.already_applied, plan.left_alone)
    changed_tasks = [task for task in playbook.tasks if task.plan(work)]
    plan.files += work.created  # first: the change probe writes in this order, so an edit importing a new file
    for rel, spans in work.per_file.items():  # (triton_backend.py's import of fleetctl_verify) never runs before it
        plan.files.append(_edit_file(rel, posixpath.join(location, rel), work.srcs[rel].text, spans,
                                     work.comments.get(rel, {})))
    return changed_tasks


def _edit_file(rel: str, path: str, text: str, spans: list, comments: dict[int, list[str]]) -> FileChange:
    pieces = sorted(spans + [(at, at, "  " + "  ".join(cs)) for at, cs in comments.items()])
    out, pos = [], 0
    for start, end, new in pieces:
        if start < pos:
            raise PlanRefused(f"overlapping edits in {rel}")
        out += [text[pos:start], new]
        pos = end
    new_text = "".join(out) + text[pos:]
    try:
        parse_python(new_text)
    except SyntaxError as e:
        raise PlanRefused(f"the edited {rel} does not parse: line {e.lineno}: {e.msg}") from None
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
    for task in playbook.tasks:
        for f in task.sites(findings):
            if (f["file"], f.get("value_line"), f.get("value_col")) in applied:
                fctx = {**ctx, "finding": {**f, "expr_one_line": one_line(f["expr"])}}
                problems += [f"{f['file']}:{f['line']}: {f['expr']!r} fails {c.source!r}" for c in checks
                             if not c(fctx)]
    return problems
