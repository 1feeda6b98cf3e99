"""`insert_text`: text inserted before a line of an install's file.

    insert_text:
      site: "findings.x.guard"          # an expression giving {file, line, present, indent}
      template: templates/x/guard.j2    # the text, rendered unstripped (with `site` in context)
      marker: "fleetctl x"              # text the rendered text must hold

`present` is the text the finding read there already: equal to the rendered text, the task is
"already applied"; any other text is refused. The line must be where a statement of the source
starts, at the site's `indent`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from ....hostpaths import package_file
from ..reader import Expr, Reader, Snippet
from .work import PlanRefused, Source, Work, parse_python


@dataclass
class InsertTask:
    """Insert `template`'s text (unstripped) before the line the `site` expression names."""

    name: str
    site: Expr
    template: Snippet
    marker: str
    notify: list[str]

    @classmethod
    def read(cls, r: Reader, node, name: str, notify: list[str]) -> "InsertTask":
        """The task from its `insert_text` mapping `node`. Raises ParseError (file:line)."""
        c = r.mapping(node, "insert_text", required=("site", "template", "marker"))
        return cls(name, r.expr(c["site"], "site"), r.template_file(c["template"], "template"),
                   r.scalar(c["marker"], "marker", str), notify)

    def sites(self, findings: dict) -> list[dict]:
        """No finding of reinspect's: the inserted text is checked by the file's sha256."""
        return []

    def plan(self, work: Work) -> bool:
        """An insertion span into `work.per_file` at the site the expression gives (True), or,
        when the site's `present` text is the rendered one, already applied (False). Raises
        PlanRefused: no site, a present text that differs, a rendered text without the marker, a
        line where no statement starts."""
        site = self.site(work.ctx)
        if not isinstance(site, dict) or not site.get("file") or not isinstance(site.get("line"), int):
            raise PlanRefused(f"{self.site.where}: {self.site.source!r} gives no site to insert at")
        rel = package_file(site["file"])
        text = self.template.render({**work.ctx, "site": site}, strip=False)
        text = text if text.endswith("\n") else text + "\n"
        if self.marker not in text:
            raise PlanRefused(f"{self.template.template.filename} must render text holding {self.marker!r}")
        entry = {"file": rel, "line": site["line"], "kind": "insert", "task": self.name}
        if site.get("present") is not None:
            if site["present"] != text:
                raise PlanRefused(f"{rel}:{site['line']} carries {self.marker!r} but not the text this playbook "
                                  "renders (changed by hand, or by another release of the playbook): roll that back "
                                  "first")
            work.already_applied.append(entry)
            return False
        src = work.source(rel)
        indent = site.get("indent", "")
        if not isinstance(indent, str) or indent.strip(" \t") or (site["line"], len(indent)) not in _statement_starts(src):
            raise PlanRefused(f"{rel}:{site['line']}: the site {self.site.source!r} gives (indent {indent!r}) is not "
                              "where a statement of the source starts: the findings do not match the source")
        at = src.offset(site["line"], 0)
        work.per_file.setdefault(rel, []).append((at, at, text))
        work.edits.append(dict(entry, new_text=text))
        return True


def _statement_starts(src: Source) -> set[tuple[int, int]]:
    """{(line, column)} (1-based line, column in characters) where a statement of `src` starts,
    a decorated definition at its first decorator's line; what an insertion site must be."""
    starts = set()
    for node in ast.walk(parse_python(src.text)):
        if isinstance(node, ast.stmt):
            line = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            head = src.text[src.starts[node.lineno - 1]:]
            col = len(head.encode("utf-8")[:node.col_offset].decode("utf-8", "replace"))
            starts.add((line, col))
    return starts
