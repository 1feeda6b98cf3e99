"""`create_file`: a new file of the install, rendered from a template.

    create_file:
      path: "{{ findings.x.file }}"     # the file, relative to the install (rendered)
      template: templates/x/new.py.j2   # its text

The file has no pre-image (FileChange.pre_sha256 None; rollback deletes it): one already there
with the rendered text is "already applied", with any other text refused.
"""

from __future__ import annotations

import difflib
import posixpath
from dataclasses import dataclass

from ....hostpaths import package_file
from ..reader import Reader, Snippet
from .work import FileChange, PlanRefused, Work, checked_source, parse_python, sha256_text


@dataclass
class CreateTask:
    """Create a file of the install (`path`, rendered) from `template`; see the module docstring."""

    name: str
    path: Snippet
    template: Snippet
    notify: list[str]

    @classmethod
    def read(cls, r: Reader, node, name: str, notify: list[str]) -> "CreateTask":
        """The task from its `create_file` mapping `node`. Raises ParseError (file:line)."""
        c = r.mapping(node, "create_file", required=("path", "template"))
        return cls(name, r.inline(c["path"], "path"), r.template_file(c["template"], "template"), notify)

    def sites(self, findings: dict) -> list[dict]:
        """No finding: the file is checked whole (its sha256) on reinspect."""
        return []

    def plan(self, work: Work) -> bool:
        """A FileChange with pre_sha256 None into `work.created` (True), or the file already
        there with exactly the rendered text (already applied, False). Raises PlanRefused: a
        file there with other text, a .py text that does not parse (Refused: a path outside
        the install)."""
        rel = package_file(self.path.render(work.ctx))
        text = self.template.render(work.ctx, strip=False)
        text = text if text.endswith("\n") else text + "\n"
        site = {"file": rel, "line": 1, "kind": "create", "task": self.name}
        if rel in (work.findings.get("files") or {}):
            if checked_source(rel, work.findings, work.sources).text != text:
                raise PlanRefused(f"{rel} exists and is not what {self.template.template.filename} renders: not "
                                  "replacing a file this playbook did not write (roll back the change that wrote it; "
                                  "one an upgrade replaced the release under, `fleetctl status` names it, is "
                                  "dropped, and this file removed, by `fleetctl rollback --forget CHANGE-ID HOSTS`)")
            work.already_applied.append(site)
            return False
        if rel.endswith(".py"):
            try:
                parse_python(text)
            except SyntaxError as e:
                raise PlanRefused(f"{self.template.template.filename} renders a {rel} that does not parse: line "
                                  f"{e.lineno}: {e.msg}") from None
        diff = "".join(difflib.unified_diff([], text.splitlines(True), "/dev/null", f"b/{rel}"))
        work.created.append(FileChange(rel, posixpath.join(work.location, rel), None, sha256_text(text), text, diff))
        work.edits.append(dict(site, new_sha256=sha256_text(text)))
        return True
