"""Playbook loading and rendering errors: every one names the file and line (exit 4)."""

from __future__ import annotations

import hashlib
import textwrap
from pathlib import Path

import pytest

from fleetctl.errors import EXIT_PARSE, ParseError
from fleetctl.engine.plan import plan_host
from fleetctl.engine.playbook import load_playbook

REPO = Path(__file__).resolve().parents[2]

GOOD = textwrap.dedent("""\
    name: t
    requires:
      - that: "findings.need_sort_origins | length > 0"
        reason: "no need_sort"
    tasks:
      - name: edit
        edit_expressions:
          findings: need_sort_origins
          when: "not finding.literal"
          value: templates/v.j2
          comment: templates/c.j2
          marker: "fleetctl t:"
        notify: [restart]
    handlers:
      - name: restart
        command: "{{ fleetctl_restart_cmd }} --now"
    validate: [compile, {reinspect: {that: "finding.expr == 'True'"}}]
    """)


def write(tmp_path: Path, yaml_text: str, value: str = "True\n", comment: str = "# fleetctl t: was {{ finding.expr }}\n"):
    (tmp_path / "templates").mkdir(exist_ok=True)
    (tmp_path / "templates" / "v.j2").write_text(value)
    (tmp_path / "templates" / "c.j2").write_text(comment)
    (tmp_path / "pb.yaml").write_text(yaml_text)
    return tmp_path / "pb.yaml"


def inputs(text="need_sort = mode in ('decode',)\n"):
    finding = {"file": "sglang/a.py", "line": 1, "kind": "assignment", "callee": None, "target": "need_sort",
               "expr": "mode in ('decode',)", "literal": False, "value_line": 1, "value_col": 12,
               "value_end_line": 1, "value_end_col": 31, "stmt_end_line": 1}
    facts = {"sglang": {"version": "0.5.x", "location": "/site"}}
    findings = {"need_sort_origins": [finding], "allocator_call_sites": [],
                "files": {"sglang/a.py": {"sha256": hashlib.sha256(text.encode()).hexdigest()}}}
    return facts, findings, {"sglang/a.py": text}


def test_shipped_playbook_loads():
    pb = load_playbook(REPO / "playbooks" / "defrag-tier0.yaml")
    assert pb.name == "defrag-tier0" and pb.on_failure == "rollback"
    assert [t.findings for t in pb.tasks] == ["need_sort_origins"]
    assert list(pb.handlers) == ["restart sglang"] and pb.tasks[0].notify == ["restart sglang"]
    assert [v.step for v in pb.validate] == ["compile", "reinspect", "smoke"]


def test_good_playbook_plans_and_renders_handler(tmp_path):
    pb = load_playbook(write(tmp_path, GOOD))
    plan = plan_host(pb, "h", {"fleetctl_restart_cmd": "systemctl restart 'sglang'"}, *inputs())
    assert plan.status == "change"
    assert plan.files[0].new_text == "need_sort = True  # fleetctl t: was mode in ('decode',)\n"
    assert plan.handlers == [{"name": "restart", "command": "systemctl restart 'sglang' --now", "wait_for_health_s": 0}]
    facts, findings, sources = inputs()
    findings["need_sort_origins"] = []
    skipped = plan_host(pb, "h", {}, facts, findings, sources)
    assert (skipped.status, skipped.reason) == ("skipped", "not applicable: no need_sort")


@pytest.mark.parametrize("yaml_text, line, words", [
    ("name: t\ntasks: [\n  - a\n", 3, "bad YAML"),
    ("name: t\ntasks:\n  - name: x\n    edit_expressions: {}\n    notify: []\n", 4, "edit_expressions lacks findings"),
    (GOOD.replace("\nhandlers:", "\nhandler:"), 14, "unknown key 'handler'"),
    (GOOD.replace("notify: [restart]", "notify: [restrat]"), 13, "notify names no handler: 'restrat'"),
    (GOOD.replace('when: "not finding.literal"', 'when: "not finding.literal and"'), 9, "bad expression"),
    (GOOD.replace("value: templates/v.j2", "value: templates/nope.j2"), 10, "no template 'templates/nope.j2'"),
    (GOOD.replace("validate: [compile,", "validate: [compiles,"), 17, "unknown validate step 'compiles'"),
    (GOOD.replace("name: t\n", "name: [t]\n", 1), 1, "name must be a string"),
    (GOOD + "on_failure: pray\n", 18, "on_failure must be one of rollback, keep"),
    ("- just\n- a list\n", 1, "playbook must be a mapping"),
])
def test_malformed_playbook_names_file_and_line(tmp_path, yaml_text, line, words):
    path = write(tmp_path, yaml_text)
    with pytest.raises(ParseError) as e:
        load_playbook(path)
    assert str(e.value).startswith(f"{path}:{line}: ") and words in str(e.value), str(e.value)
    assert e.value.exit_code == EXIT_PARSE == 4


def test_template_syntax_error_names_template_line(tmp_path):
    path = write(tmp_path, GOOD, value="True\n{% if %}\n")
    with pytest.raises(ParseError, match=r"templates/v\.j2:2: "):
        load_playbook(path)


def test_undefined_variable_names_template_and_line(tmp_path):
    pb = load_playbook(write(tmp_path, GOOD, comment="# fleetctl t: was\n{{ finding.expr }} {{ fleetctl_nope }}\n"))
    with pytest.raises(ParseError) as e:
        plan_host(pb, "h", {"fleetctl_restart_cmd": "x"}, *inputs())
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'templates' / 'c.j2'}:2: ") and "'fleetctl_nope' is undefined" in msg, msg


def test_undefined_variable_in_handler_command_names_playbook_line(tmp_path):
    pb = load_playbook(write(tmp_path, GOOD))
    with pytest.raises(ParseError) as e:
        plan_host(pb, "h", {}, *inputs())  # no fleetctl_restart_cmd and the handler has no `when`
    assert str(e.value).startswith(f"{tmp_path / 'pb.yaml'}:16: ") and "'fleetctl_restart_cmd' is undefined" in str(e.value)


def test_undefined_field_in_when_names_playbook_line(tmp_path):
    pb = load_playbook(write(tmp_path, GOOD.replace("not finding.literal", "not finding.literall")))
    with pytest.raises(ParseError, match=r"pb\.yaml:9: .*literall"):
        plan_host(pb, "h", {"fleetctl_restart_cmd": "x"}, *inputs())


def test_a_value_that_parses_alone_but_breaks_the_file_is_refused(tmp_path):
    """A value template's text is an expression on its own (`True  # was ...`), but inside a call
    its comment swallows the closing parenthesis: the plan is refused with the line and Python's
    message, and no file change is planned."""
    pb = load_playbook(write(tmp_path, GOOD, value="True  # was {{ finding.expr }}\n"))
    text = "x = f(need_sort=mode in ('decode',))\n"
    facts, findings, sources = inputs(text)
    findings["need_sort_origins"][0].update(kind="keyword", callee="f", target=None, value_col=16, value_end_col=35)
    assert text[16:35] == findings["need_sort_origins"][0]["expr"]
    plan = plan_host(pb, "h", {}, facts, findings, sources)
    assert (plan.status, plan.reason, plan.files) == (
        "failed", "the edited sglang/a.py does not parse: line 1: '(' was never closed", [])
