"""Playbook loading and rendering errors: every one names the file and line (exit 4)."""

from __future__ import annotations

import hashlib
import os
import textwrap
from pathlib import Path

import jinja2
import pytest

from fleetctl import probes
from fleetctl.errors import EXIT_PARSE, ParseError
from fleetctl.engine.playbooks.plan import plan_host
from fleetctl.engine.playbooks import reader
from fleetctl.engine.playbooks.model import load_playbook
from fleetctl.engine.playbooks.reader import TemplateRefused

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
    assert [v.step for v in pb.validate] == ["compile", "reinspect", "smoke", "load"]


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


# Review N8: the playbook and its templates are read only from regular files inside the
# playbook's directory, reached without links, that only the operator (or root) can change.
LINKED = ("fleetctl reads a playbook and its templates only from regular files inside the playbook's directory, "
          "reached without links; copy the file in")


@pytest.fixture
def secret(tmp_path_factory):
    """A file outside every playbook directory, as /root/.ssh/id_ed25519 would be."""
    path = tmp_path_factory.mktemp("outside") / "id_ed25519"
    path.write_text("TOPSECRET-key\n")
    path.chmod(0o600)
    return path


def test_a_symlinked_template_is_refused_naming_the_playbook_line(tmp_path, secret):
    """value: templates/v.j2, a link to a file outside: refused at load with the playbook's
    file:line, the link and its target; so is a link that stays inside the directory, and a
    linked directory on the way."""
    path = write(tmp_path, GOOD)
    v = tmp_path / "templates" / "v.j2"
    v.unlink()
    v.symlink_to(secret)
    with pytest.raises(ParseError) as e:
        load_playbook(path)
    assert str(e.value) == f"{path}:10: value: template 'templates/v.j2': {v} is a symbolic link (to {secret}): {LINKED}"
    v.unlink()
    (tmp_path / "templates" / "real.j2").write_text("True\n")
    v.symlink_to("real.j2")
    with pytest.raises(ParseError) as e:
        load_playbook(path)
    assert str(e.value) == f"{path}:10: value: template 'templates/v.j2': {v} is a symbolic link (to real.j2): {LINKED}"
    v.unlink()
    v.write_text("True\n")
    (tmp_path / "templates").rename(tmp_path / "elsewhere")
    (tmp_path / "templates").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ParseError) as e:
        load_playbook(path)
    assert str(e.value) == (f"{path}:10: value: template 'templates/v.j2': {tmp_path / 'templates'} is a symbolic link "
                            f"(to {tmp_path / 'elsewhere'}): {LINKED}")


def test_an_include_of_a_symlink_is_refused_naming_the_template_line(tmp_path, secret):
    """{% include %} (and `ignore missing`, which skips only what does not exist) of a link in a
    comment template is refused when rendered, naming the including template's line; in an
    inline handler command, the playbook's line. The secret is in no message and no plan."""
    comment = "# fleetctl t: was {{ finding.expr }}\n{% include 'templates/notes.j2' ignore missing %}\n"
    path = write(tmp_path, GOOD, comment=comment)
    (tmp_path / "templates" / "notes.j2").symlink_to(secret)
    pb = load_playbook(path)  # the include is looked up when the comment renders
    with pytest.raises(ParseError) as e:
        plan_host(pb, "h", {"fleetctl_restart_cmd": "x"}, *inputs())
    notes = tmp_path / "templates" / "notes.j2"
    assert str(e.value) == (f"{tmp_path / 'templates' / 'c.j2'}:2: template 'templates/notes.j2': {notes} is a symbolic "
                            f"link (to {secret}): {LINKED}")
    pb = load_playbook(write(tmp_path, GOOD.replace("--now", "{% include 'templates/notes.j2' %}")))
    with pytest.raises(ParseError) as e:
        plan_host(pb, "h", {"fleetctl_restart_cmd": "x"}, *inputs())
    assert str(e.value) == f"{path}:16: template 'templates/notes.j2': {notes} is a symbolic link (to {secret}): {LINKED}"
    assert "TOPSECRET" not in str(e.value)


def test_a_linked_playbook_file_and_a_directory_others_may_change_are_refused(tmp_path, secret, monkeypatch):
    """The playbook file a link (even to a playbook): refused. The playbook's directory, or a
    template directory, writable by group or others, or owned by another user than the
    operator and root: refused, saying why and what to do."""
    path = write(tmp_path, GOOD)
    (tmp_path / "link.yaml").symlink_to(path)
    with pytest.raises(ParseError) as e:
        load_playbook(tmp_path / "link.yaml")
    assert str(e.value) == (f"{tmp_path / 'link.yaml'}: cannot read playbook: playbook 'link.yaml': "
                            f"{tmp_path / 'link.yaml'} is a symbolic link (to {path}): {LINKED}")
    tmp_path.chmod(0o775)
    with pytest.raises(ParseError) as e:
        load_playbook(path)
    assert str(e.value) == (f"{path}: cannot read playbook: the playbook directory {tmp_path} is writable by group or "
                            f"others (mode 775): they could change the playbook after you read it; chmod go-w {tmp_path}")
    tmp_path.chmod(0o700)
    (tmp_path / "templates").chmod(0o757)
    with pytest.raises(ParseError) as e:
        load_playbook(path)
    assert str(e.value) == (f"{path}:10: value: {tmp_path / 'templates'} is writable by group or others (mode 757): "
                            f"they could change the playbook after you read it; chmod go-w {tmp_path / 'templates'}")
    (tmp_path / "templates").chmod(0o755)
    assert load_playbook(path).name == "t"
    if os.geteuid() == 0:  # another owner for real; else the operator pretends to be another user
        os.chown(tmp_path, 4243, -1)
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    owner = tmp_path.stat().st_uid
    with pytest.raises(ParseError) as e:
        load_playbook(path)
    assert str(e.value) == (f"{path}: cannot read playbook: the playbook directory {tmp_path} is owned by uid {owner}, "
                            "not by you (uid 4242) or root: its owner could change the playbook after you read it; "
                            "copy the playbook into a directory of yours")


def test_a_dotfile_of_the_playbook_directory_is_never_read(tmp_path):
    """A playbook saved in a home directory makes it the playbook directory: its .ssh/ and
    .git/config must stay out of reach (red-team finding on N8)."""
    (tmp_path / ".ssh").mkdir(mode=0o700)
    (tmp_path / ".ssh" / "id_test").write_text("PRIVATE-KEY-MATERIAL\n")
    with pytest.raises(TemplateRefused, match=r"\.ssh is a hidden name"):
        reader.read_inside(str(tmp_path), ".ssh/id_test")
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / ".env").write_text("TOKEN=x\n")
    with pytest.raises(TemplateRefused, match=r"\.env is a hidden name"):
        reader.read_inside(str(tmp_path), "templates/.env")


def test_a_fleetctl_probe_is_the_one_text_read_from_outside_the_playbook_directory(tmp_path):
    """`fleetctl:probes/NAME.py` is probe NAME's source as the bundler ships it (whatever the
    playbook's directory holds); a name of any other form after that prefix is refused, and one
    that names no probe is not found."""
    loader = reader.PlaybookLoader(str(tmp_path))
    (tmp_path / "fleetctl:probes").mkdir()
    (tmp_path / "fleetctl:probes" / "buildtrust.py").write_text("not fleetctl's\n")
    text, path, _ = loader.get_source(None, "fleetctl:probes/buildtrust.py")
    assert text == probes.source("buildtrust") and path == str(Path(probes.__file__).parent / "buildtrust.py")
    assert loader.get_source(None, "fleetctl:probes/facts/verifyroute.py")[0] == probes.source("facts.verifyroute")
    for name in ("fleetctl:probes/../config.py", "fleetctl:probes//etc/passwd.py", "fleetctl:probes/a/b/c.py",
                 "fleetctl:probes/buildtrust", "fleetctl:probes/buildtrust.j2", "fleetctl:probes/.x.py"):
        with pytest.raises(TemplateRefused, match="names a probe module of fleetctl's"):
            loader.get_source(None, name)
    with pytest.raises(jinja2.TemplateNotFound):
        loader.get_source(None, "fleetctl:probes/nosuch.py")
