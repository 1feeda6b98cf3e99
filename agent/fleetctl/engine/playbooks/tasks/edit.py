"""`edit_expressions`: replace the value span of each selected inspect finding with the task's
rendered value, and append the rendered comment at the first line end after the value.

    edit_expressions:
      findings: need_sort_origins       # key of the inspect findings holding the sites
      when: "not finding.literal"       # which findings to change (expression over `finding`)
      value: templates/x/value.py.j2    # renders the new Python expression
      comment: templates/x/comment.j2   # renders the one-line trailing comment
      marker: "fleetctl x:"             # text in that comment that marks an applied edit

A finding's span is 1-based lines and 0-based character columns, from the inspect probe's AST
reading; the comment goes at the first line end after the value (for an assignment the
statement's last line, for a keyword its own line inside the call; tokenize finds it, so
backslash continuations stay intact). A site whose comment line already carries the marker, whose
value is what the task writes, and that `when` no longer selects is "already applied"; a marked
site that `when` still selects was changed by hand after the apply, and the host is refused
rather than edited twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from ....hostpaths import package_file
from ..reader import Expr, Reader, Snippet
from .work import ANY_LINE_BREAK, PlanRefused, Work, one_line, parse_python


@dataclass
class EditTask:
    """Replace the value expression of each selected finding; see the module docstring."""

    name: str
    findings: str
    when: Expr
    value: Snippet
    comment: Snippet
    marker: str
    notify: list[str]

    @classmethod
    def read(cls, r: Reader, node, name: str, notify: list[str]) -> "EditTask":
        """The task from its `edit_expressions` mapping `node`. Raises ParseError (file:line)."""
        e = r.mapping(node, "edit_expressions", required=("findings", "when", "value", "comment", "marker"))
        return cls(name, r.scalar(e["findings"], "findings", str), r.expr(e["when"], "when"),
                   r.template_file(e["value"], "value"), r.template_file(e["comment"], "comment"),
                   r.scalar(e["marker"], "marker", str), notify)

    def sites(self, findings: dict) -> list[dict]:
        """The findings this task edits, which validate's `reinspect` checks once edited."""
        return findings.get(self.findings) or []

    def plan(self, work: Work) -> bool:
        """Plan the edit of each finding of `self.findings`: spans and comments into `work`.
        True when a site is to change. Raises PlanRefused: findings that do not match the source,
        a marked site `when` still selects, a value that is no Python expression, a comment that
        is not one '#' line holding the marker."""
        changed = False
        for f in self.sites(work.findings):
            rel = package_file(f["file"])  # a playbook's task may name any findings list
            fctx = {**work.ctx, "finding": {**f, "expr_one_line": one_line(f["expr"])}}
            src = work.source(rel)
            start = src.offset(f["value_line"], f["value_col"])
            end = src.offset(f["value_end_line"], f["value_end_col"])
            if src.text[start:end] != f["expr"]:
                raise PlanRefused(f"findings do not match the source at {rel}:{f['line']}")
            row, at = src.line_end_after(f["value_end_line"], f["value_end_col"])
            marked = self.marker in src.comments.get(row, "")
            selected = bool(self.when(fctx))
            if marked and selected:
                raise PlanRefused(f"{rel}:{f['line']} carries {self.marker!r} but its value was changed since")
            if marked and f["expr"] == self.value.render(fctx):
                # the site itself holds what the task writes (another finding on the same marked
                # line, say a nested literal, is left alone below)
                work.already_applied.append(_site(f, task=self.name))
                continue
            if not selected:
                work.left_alone.append(_site(f, literal=f.get("literal")))
                continue
            value, comment = self.value.render(fctx), self.comment.render(fctx)
            try:
                parse_python(value, mode="eval")
            except SyntaxError:
                raise PlanRefused(f"{self.value.template.filename} renders {value!r}, not a Python expression") from None
            if ANY_LINE_BREAK.search(comment) or not comment.startswith("#") or self.marker not in comment:
                raise PlanRefused(f"{self.comment.template.filename} must render one '#' line holding {self.marker!r}")
            work.per_file.setdefault(rel, []).append((start, end, value))
            work.comments.setdefault(rel, {}).setdefault(at, []).append(comment)
            work.edits.append(_site(f, old_expr=f["expr"], new_expr=value, task=self.name))
            changed = True
        return changed


def _site(f: dict, **extra) -> dict:
    return {"file": f["file"], "line": f["line"], "kind": f.get("kind"), "callee": f.get("callee"),
            "expr": f["expr"], "value_line": f.get("value_line"), "value_col": f.get("value_col"), **extra}
