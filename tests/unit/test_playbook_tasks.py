"""The playbook schema's create_file and insert_text tasks and `refuse` requirements (what
route-verify-attention is written in): loaded and checked, each error naming the file and line."""

from __future__ import annotations

import hashlib
import textwrap
from pathlib import Path

import pytest

from fleetctl.engine.playbooks.plan import plan_host
from fleetctl.engine.playbooks.model import load_playbook
from fleetctl.engine.playbooks.tasks.create import CreateTask
from fleetctl.engine.playbooks.tasks.insert import InsertTask
from fleetctl.errors import ParseError

PB = textwrap.dedent("""\
    name: t
    requires:
      - that: "findings.x.ok"
        refuse: true
        reason: "{{ findings.x.why }}"
    tasks:
      - name: new
        create_file:
          path: "sglang/{{ findings.x.name }}.py"
          template: templates/new.py.j2
      - name: guard
        insert_text:
          site: "findings.x.site"
          template: templates/guard.j2
          marker: "fleetctl t"
    """)


def write(tmp_path: Path, text: str = PB) -> Path:
    (tmp_path / "templates").mkdir(exist_ok=True)
    (tmp_path / "templates" / "new.py.j2").write_text("X = {{ findings.x.value }}\n")
    (tmp_path / "templates" / "guard.j2").write_text("{{ site.indent }}pass  # fleetctl t\n")
    (tmp_path / "pb.yaml").write_text(text)
    return tmp_path / "pb.yaml"


def inputs(ok=True, present=None):
    text = "def f():\n    return 1\n"
    files = {"sglang/a.py": {"sha256": hashlib.sha256(text.encode()).hexdigest(), "size": len(text)}}
    x = {"ok": ok, "why": "the host said no", "name": "made", "value": 3,
         "site": {"file": "sglang/a.py", "line": 2, "indent": "    ", "present": present}}
    return {"sglang": {"location": "/site"}}, {"x": x, "files": files}, {"sglang/a.py": text}


def test_create_and_insert_tasks_load_and_plan(tmp_path):
    pb = load_playbook(write(tmp_path))
    assert [type(t) for t in pb.tasks] == [CreateTask, InsertTask] and pb.requires[0].refuse
    plan = plan_host(pb, "h", {}, *inputs())
    assert plan.status == "change", plan.reason
    files = {f.rel: f for f in plan.files}
    assert files["sglang/made.py"].pre_sha256 is None and files["sglang/made.py"].new_text == "X = 3\n"
    assert files["sglang/a.py"].new_text == "def f():\n    pass  # fleetctl t\n    return 1\n"
    applied = plan_host(pb, "h", {}, *inputs(present="    pass  # fleetctl t\n"))
    assert [e["kind"] for e in applied.edits] == ["create"] and [a["kind"] for a in applied.already_applied] == ["insert"]


def test_a_refusing_requirement_fails_the_host_with_its_rendered_reason(tmp_path):
    plan = plan_host(load_playbook(write(tmp_path)), "h", {}, *inputs(ok=False))
    assert (plan.status, plan.reason, plan.files) == ("failed", "refused: the host said no", [])
    skip = load_playbook(write(tmp_path, PB.replace("    refuse: true\n", "")))
    plan = plan_host(skip, "h", {}, *inputs(ok=False))
    assert (plan.status, plan.reason) == ("skipped", "not applicable: the host said no")


@pytest.mark.parametrize("change, line, words", [
    (("    create_file:\n", "    insert_text: {}\n    create_file:\n"), 7,
     "a task has one of edit_expressions, create_file, insert_text"),
    (("    refuse: true\n", "    refuse: yes please\n"), 4, "refuse must be true or false"),
    (("      template: templates/new.py.j2\n", "      template: templates/nope.j2\n"), 10,
     "no template 'templates/nope.j2'"),
    (("      marker: \"fleetctl t\"\n", ""), 13, "insert_text lacks marker"),
])
def test_malformed_tasks_name_file_and_line(tmp_path, change, line, words):
    path = write(tmp_path, PB.replace(*change))
    with pytest.raises(ParseError) as e:
        load_playbook(path)
    assert str(e.value).startswith(f"{path}:{line}: ") and words in str(e.value), str(e.value)


def test_an_insert_without_its_marker_or_site_is_refused(tmp_path):
    path = write(tmp_path)
    (tmp_path / "templates" / "guard.j2").write_text("pass\n")
    plan = plan_host(load_playbook(path), "h", {}, *inputs())
    assert plan.status == "failed" and "must render text holding 'fleetctl t'" in plan.reason
    facts, findings, sources = inputs()
    findings["x"]["site"] = None
    plan = plan_host(load_playbook(write(tmp_path)), "h", {}, facts, findings, sources)
    assert plan.status == "failed" and "gives no site to insert at" in plan.reason


@pytest.mark.parametrize("line, indent", [(0, "    "), (3, "    "), (2, ""), (2, "  "), (1, "    "),
                                          (2, "os.system(1)\n    "), (2, 4)])
def test_an_insert_site_where_no_statement_starts_is_refused(tmp_path, line, indent):
    """A site out of the file, not at a statement's own start and indentation, or an indent that
    is not whitespace (code the guard template would render) is refused, nothing planned."""
    facts, findings, sources = inputs()
    findings["x"]["site"].update(line=line, indent=indent)
    plan = plan_host(load_playbook(write(tmp_path)), "h", {}, facts, findings, sources)
    assert plan.status == "failed" and plan.files == [], plan.reason
    assert plan.reason == (f"sglang/a.py:{line}: the site 'findings.x.site' gives (indent {indent!r}) is not where a "
                           "statement of the source starts: the findings do not match the source")
