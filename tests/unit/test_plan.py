"""plan_host on real SGLang releases (unpacked from the cached wheels) and on edge-case sources.

Findings are produced by a small independent AST reading in the inspect probe's JSON shape
(tests/oracles.py host_inputs), so the planner is tested without SSH and without the inspect probe.
"""

from __future__ import annotations

import ast
import hashlib
import shutil
import textwrap
import zipfile

import pytest

from fleetctl.engine.playbooks.plan import plan_host, reinspect_problems
from fleetctl.engine.playbooks.tasks.work import one_line
from fleetctl.engine.playbooks.model import load_playbook
from fleetctl.wheels import ensure_wheel
from oracles import PLAYBOOK, apply_diff, host_inputs

MARK = "# fleetctl defrag-tier0: was "
_RELEASES: dict[str, dict[str, str]] = {}


def release_files(version: str) -> dict[str, str]:
    """{rel: text} of the release's sglang .py files that mention need_sort (the cheap filter)."""
    if version not in _RELEASES:
        with zipfile.ZipFile(ensure_wheel(version)) as z:
            _RELEASES[version] = {n: z.read(n).decode() for n in z.namelist()
                                  if n.startswith("sglang/") and n.endswith(".py") and b"need_sort" in z.read(n)}
    return _RELEASES[version]


def computed(findings: list[dict]) -> list[dict]:
    """Computed origins, read independently: local `need_sort = expr` or keyword, not literal, not a bare name."""
    return [f for f in findings if not f["literal"] and not f["expr"].isidentifier()
            and (f["kind"] == "keyword" or f["target"] == "need_sort")]


def test_apply_diff_refuses_a_reversed_diff():
    """The helper itself can fail: a diff applied to the wrong side does not apply."""
    import difflib
    old, new = "a\nb\nc\n", "a\nB\nc\nd\n"
    diff = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), "a/f", "b/f"))
    assert apply_diff(old, diff, "f") == new
    reverse = "".join(difflib.unified_diff(new.splitlines(True), old.splitlines(True), "a/f", "b/f"))
    with pytest.raises(AssertionError):
        apply_diff(old, reverse, "f")


@pytest.fixture(scope="module")
def pb():
    return load_playbook(PLAYBOOK)


EXPECTED = {"0.5.23": 4, "0.5.10": 1, "0.5.2": 1}


@pytest.mark.releases
@pytest.mark.parametrize("version", sorted(EXPECTED))
def test_real_release_plan_apply_replan(pb, version):
    files = release_files(version)
    facts, findings, sources = host_inputs(files)
    before = findings["need_sort_origins"]
    want = computed(before)
    assert len(want) == EXPECTED[version]
    plan = plan_host(pb, "h1", {}, facts, findings, sources)
    assert plan.status == "change", plan.reason
    assert len(plan.edits) == EXPECTED[version]
    assert {(e["file"], e["line"]) for e in plan.edits} == {(f["file"], f["line"]) for f in want}
    assert {(s["file"], s["line"]) for s in plan.left_alone} == \
        {(f["file"], f["line"]) for f in before} - {(f["file"], f["line"]) for f in want}
    patched = dict(files)
    for fc in plan.files:
        assert fc.pre_sha256 == findings["files"][fc.rel]["sha256"]
        assert fc.post_sha256 == hashlib.sha256(fc.new_text.encode()).hexdigest()
        assert fc.path == f"{facts['sglang']['location']}/{fc.rel}"
        assert apply_diff(files[fc.rel], fc.diff, fc.rel) == fc.new_text  # the diff the operator approves
        ast.parse(fc.new_text)
        patched[fc.rel] = fc.new_text
    # independent re-read: no computed origin left, each edited one now reads True with its comment
    facts2, findings2, sources2 = host_inputs(patched)
    after = findings2["need_sort_origins"]
    assert computed(after) == []
    trues = [f for f in after if f["literal"] and f["expr"] == "True"]
    assert len(trues) == EXPECTED[version]
    for f in trues:
        line = patched[f["file"]].split("\n")[f["value_end_line"] - 1]
        assert MARK in line
    old = {one_line(f["expr"]) for f in want}
    was = [l.split(MARK, 1)[1] for t in plan.files for l in t.new_text.split("\n") if MARK in l]
    assert set(was) == old
    if version == "0.5.23":  # spelled out by hand from the release's source (lines 932, 1025, 1511, 2805)
        assert was == ['get_disagg().disaggregation_mode in ("decode", "prefill")'] * 4
    # literal origins and pass-through sites are untouched
    lit = lambda fs: [(f["file"], f["expr"]) for f in fs if f["literal"] and f["expr"] != "True"]
    assert lit(after) == lit(before)
    for rel, text in files.items():
        passes = [l for l in text.split("\n") if "need_sort=need_sort" in l.replace(" ", "")]
        assert passes == [l for l in patched[rel].split("\n") if "need_sort=need_sort" in l.replace(" ", "")]
    # idempotent: replanning on the patched text has nothing to do
    again = plan_host(pb, "h1", {}, facts2, findings2, sources2)
    assert again.status == "ok" and again.edits == [] and again.files == []
    assert len(again.already_applied) == EXPECTED[version]
    assert reinspect_problems(pb, plan, {}, facts2, findings2, sources2) == []
    # ...and a host still on the original text fails the reinspect validation
    assert reinspect_problems(pb, plan, {}, facts, findings, sources)


def test_release_without_need_sort_is_skipped(pb):
    facts, findings, sources = host_inputs(release_files("0.4.6.post5"))
    assert findings["need_sort_origins"] == []
    plan = plan_host(pb, "old", {}, facts, findings, sources)
    assert plan.status == "skipped" and plan.reason.startswith("not applicable:")
    assert plan.files == [] and plan.to_dict()["status"] == "skipped"
    facts["sglang"] = None
    assert plan_host(pb, "old", {}, facts, findings, sources).reason == "not applicable: sglang is not installed"


def test_changed_since_inspect_is_refused(pb):
    facts, findings, sources = host_inputs(release_files("0.5.10"))
    rel = next(iter(sources))
    sources[rel] += "\n# edited after inspect\n"
    plan = plan_host(pb, "h", {}, facts, findings, sources)
    assert plan.status == "failed" and plan.reason == f"changed since inspect: {rel}"
    assert plan.files == []


EDGE = textwrap.dedent('''\
    def f(mode, kw, make):
        nom = "é€"; need_sort = mode in (
            "decode",  # comment inside
            "prefill",
        )
        x = make(a=1, need_sort=mode == "decode" \\
                 or kw, b=2)  # existing comment
        y = make(need_sort=need_sort, other=False)
        z = make(need_sort=False)
        self_like = make(1, need_sort=(mode
                                      is not None))
        return make(nom, need_sort=bool(kw)), x, y, z, self_like
    ''')


def test_edge_cases_multiline_unicode_backslash(pb):
    facts, findings, sources = host_inputs({"sglang/edge.py": EDGE})
    plan = plan_host(pb, "h", {"fleetctl_restart_cmd": "systemctl restart sglang"}, facts, findings, sources)
    assert plan.status == "change", plan.reason
    assert [e["line"] for e in plan.edits] == [2, 6, 10, 12]
    assert [s["expr"] for s in plan.left_alone] == ["False"]
    new = plan.files[0].new_text
    assert apply_diff(EDGE, plan.files[0].diff, "sglang/edge.py") == new
    tree = ast.parse(new)
    assert '"é€"; need_sort = True  # fleetctl defrag-tier0: was mode in ("decode", "prefill",)' in new
    assert 'need_sort=True, b=2)  # existing comment  # fleetctl defrag-tier0: was mode == "decode" or kw' in new
    assert "need_sort=(True))  # fleetctl defrag-tier0: was mode is not None\n" in new  # parens are not the value
    assert "need_sort=bool(kw)" not in new and "need_sort=need_sort, other=False" in new
    trues = [k for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords
             if k.arg == "need_sort" and isinstance(k.value, ast.Constant)]
    assert sorted(k.value.value for k in trues) == [False, True, True, True]
    assert plan.handlers == [{"name": "restart sglang", "command": "systemctl restart sglang",
                              "wait_for_health_s": 600}]
    # smoke is always planned; apply reports it skipped when the host has no server or command
    assert plan.validate == [{"step": "compile"}, {"step": "reinspect"}, {"step": "smoke"}]
    f2, fi2, s2 = host_inputs({"sglang/edge.py": new})
    assert plan_host(pb, "h", {}, f2, fi2, s2).status == "ok"


def test_hand_edit_after_apply_is_refused(pb):
    facts, findings, sources = host_inputs({"sglang/a.py": "need_sort = a in b\n"})
    new = plan_host(pb, "h", {}, facts, findings, sources).files[0].new_text
    assert new == "need_sort = True  # fleetctl defrag-tier0: was a in b\n"
    assert plan_host(pb, "h", {}, facts, findings, sources).files[0].diff == (
        "--- a/sglang/a.py\n+++ b/sglang/a.py\n@@ -1 +1 @@\n"
        "-need_sort = a in b\n+need_sort = True  # fleetctl defrag-tier0: was a in b\n")
    f2, fi2, s2 = host_inputs({"sglang/a.py": new.replace("True", "a or b")})
    p = plan_host(pb, "h", {}, f2, fi2, s2)
    assert p.status == "failed" and "changed since" in p.reason


@pytest.mark.releases
@pytest.mark.parametrize("version", ["0.5.23", "0.5.10"])
def test_plan_from_the_inspect_probe_findings(pb, tmp_path, version):
    """The real inspect probe (probes/facts/callsites.py) on the release's files gives the same plan."""
    from fleetctl.probes.facts.callsites import scan

    files = release_files(version)
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(text.encode())
    findings = scan(str(tmp_path))
    sources = {rel: files[rel] for rel in {f["file"] for f in findings["need_sort_origins"]}}
    facts = {"sglang": {"version": version, "location": str(tmp_path)}}
    plan = plan_host(pb, "h", {}, facts, findings, sources)
    mine = plan_host(pb, "h", {}, *host_inputs(files, location=str(tmp_path)))
    assert plan.status == "change" and len(plan.edits) == EXPECTED[version]
    assert [(f.rel, f.post_sha256) for f in plan.files] == [(f.rel, f.post_sha256) for f in mine.files]
    for fc in plan.files:
        (tmp_path / fc.rel).write_text(fc.new_text)
    again = scan(str(tmp_path))
    assert [f for f in again["need_sort_origins"] if not f["literal"]] == []
    patched = {rel: (tmp_path / rel).read_text() for rel in sources}
    assert plan_host(pb, "h", {}, facts, again, patched).status == "ok"
    assert reinspect_problems(pb, plan, {}, facts, again, patched) == []


@pytest.mark.parametrize("src, want", [
    # the comment goes after the value, before the line's trailing blanks (which stay)
    ("need_sort = a in b  \t\n", "need_sort = True  # fleetctl defrag-tier0: was a in b  \t\n"),
    # a value ending in a letter is not trimmed
    ("need_sort = a in AX\n", "need_sort = True  # fleetctl defrag-tier0: was a in AX\n"),
    # an existing comment is kept, the marker goes after it
    ("x = f(need_sort=a or b)   # keep\n", "x = f(need_sort=True)   # keep  # fleetctl defrag-tier0: was a or b\n"),
])
def test_comment_position(pb, src, want):
    plan = plan_host(pb, "h", {}, *host_inputs({"sglang/a.py": src}))
    assert plan.files[0].new_text == want
    assert apply_diff(src, plan.files[0].diff, "sglang/a.py") == want


def test_two_edits_on_one_line_and_refusals(pb):
    """Two sites on one line: both comments at its end, in order. A value inside another value,
    and a finding without its source text, are refused with the reason."""
    src = "x = f(need_sort=a or b, y=g(need_sort=c or d))\n"
    plan = plan_host(pb, "h", {}, *host_inputs({"sglang/a.py": src}))
    assert plan.files[0].new_text == ("x = f(need_sort=True, y=g(need_sort=True))  # fleetctl defrag-tier0: was a or b"
                                      "  # fleetctl defrag-tier0: was c or d\n")
    nested = plan_host(pb, "h", {}, *host_inputs({"sglang/a.py": "x = f(need_sort=g(need_sort=a or b))\n"}))
    assert (nested.status, nested.reason, nested.files) == ("failed", "overlapping edits in sglang/a.py", [])
    facts, findings, sources = host_inputs({"sglang/a.py": "need_sort = a or b\n"})
    gone = plan_host(pb, "h", {}, facts, findings, {})
    assert (gone.status, gone.reason) == ("failed", "no source text for sglang/a.py")


def test_one_line():
    """Single-line values are kept verbatim; a comment or a line break sends them through tokenize,
    which keeps the tokens and puts one space where there was any whitespace."""
    assert one_line("  a  or  b ") == "a  or  b"
    assert one_line('a  or  "#"') == 'a or "#"'
    assert one_line("X or\n  X") == "X or X"
    assert one_line("f(\n  a,  # why\n  b,\n)") == "f(a, b,)"


def test_crlf_source(pb):
    text = "x = 1\r\nneed_sort = a in (\r\n    b)\r\ny = make(need_sort=c or d)\r\n"
    facts, findings, sources = host_inputs({"sglang/w.py": text})
    plan = plan_host(pb, "h", {}, facts, findings, sources)
    assert plan.files[0].new_text == ("x = 1\r\nneed_sort = True  # fleetctl defrag-tier0: was a in (b)\r\n"
                                      "y = make(need_sort=True)  # fleetctl defrag-tier0: was c or d\r\n")
    assert apply_diff(text, plan.files[0].diff, "sglang/w.py") == plan.files[0].new_text


def test_offline_smoke_command_is_rendered_per_host(tmp_path):
    """A playbook's smoke step may carry an offline command, rendered from the host's vars."""
    text = PLAYBOOK.read_text().replace(
        "  - smoke\n", "  - smoke:\n      offline: \"{{ fleetctl_python }} -m sglang.bench_one_batch --batch-size 1\"\n")
    assert "offline:" in text
    shutil.copytree(PLAYBOOK.parent / "templates", tmp_path / "templates")
    path = tmp_path / "p.yaml"
    path.write_text(text)
    facts, findings, sources = host_inputs(release_files("0.5.23"))
    plan = plan_host(load_playbook(path), "h", {"fleetctl_python": "/opt/v/bin/python"}, facts, findings, sources)
    assert plan.validate[-1] == {"step": "smoke", "offline": "/opt/v/bin/python -m sglang.bench_one_batch --batch-size 1"}


def test_reinspect_checks_only_the_edited_site_not_its_line(pb):
    """A literal origin on the same line as an edited one is not judged by the reinspect check."""
    src = "def f(a, g):\n    return f(need_sort=a.b, x=g(need_sort=False))\n"
    facts, findings, sources = host_inputs({"sglang/x.py": src})
    plan = plan_host(pb, "h", {}, facts, findings, sources)
    assert plan.status == "change" and [e["expr"] for e in plan.edits] == ["a.b"]
    f2, fi2, s2 = host_inputs({"sglang/x.py": plan.files[0].new_text})
    assert reinspect_problems(pb, plan, {}, f2, fi2, s2) == []


@pytest.mark.parametrize("src", ['need_sort = x == "\u2028"\n', 'need_sort = x == "\x0c"\n'])
def test_a_comment_that_would_break_its_line_is_refused(pb, src):
    """A value whose text holds a line separator (a lone CR ends a line for Python's tokenizer;
    the rest for str.splitlines) must not reach the one-line comment (review L5)."""
    plan = plan_host(pb, "h", {}, *host_inputs({"sglang/a.py": src}))
    assert (plan.status, plan.files) == ("failed", [])
    assert plan.reason.endswith("comment.j2 must render one '#' line holding 'fleetctl defrag-tier0:'"), plan.reason


def renamed(inputs: tuple, old: str, new: str) -> tuple:
    """(facts, findings, sources) with file `old` named `new` everywhere the host names it (each
    finding's file, the keys of findings["files"] and of sources), as a hostile host's answer."""
    facts, findings, sources = inputs
    ren = lambda d: {(new if k == old else k): v for k, v in d.items()}  # noqa: E731
    lists = {k: [dict(f, file=new) if f["file"] == old else f for f in v]
             for k, v in findings.items() if k != "files"}
    return facts, {**lists, "files": ren(findings["files"])}, ren(sources)


HOSTILE = [("../x", "not relative to the install"), ("/x", "not relative to the install"),
           ("sglang/a\x00b", "holds the character U+0000"), ("sglang/a\nb", "holds the character U+000A"),
           ("sglang/../../x", "not relative to the install"), ("x.py", "not under sglang/")]


@pytest.mark.parametrize("rel, why", HOSTILE)
def test_a_finding_outside_the_install_is_refused(pb, rel, why):
    """A host names a finding's file (and the same key in files and sources) outside the install:
    the plan fails naming the path, with no file in it (review N2: plan.py joined it blindly)."""
    inputs = renamed(host_inputs({"sglang/a.py": "need_sort = a or b\n"}), "sglang/a.py", rel)
    assert inputs[1]["need_sort_origins"][0]["file"] == rel and set(inputs[2]) == {rel}
    plan = plan_host(pb, "lab-04", {}, *inputs)
    assert (plan.status, plan.reason) == ("failed", f"refused a path from the host: {rel!r} ({why})")
    assert (plan.files, plan.edits) == ([], [])


@pytest.mark.parametrize("where", ["files", "sources"])
def test_a_stray_key_outside_the_install_is_refused(pb, where):
    """A key no finding names, in findings["files"] or in sources, is refused all the same."""
    facts, findings, sources = host_inputs({"sglang/a.py": "need_sort = a or b\n"})
    (findings["files"] if where == "files" else sources)["../../etc/cron.d/x"] = \
        {"sha256": "0" * 64, "size": 0} if where == "files" else "x = 1\n"
    plan = plan_host(pb, "lab-04", {}, facts, findings, sources)
    assert (plan.status, plan.reason, plan.files) == (
        "failed", "refused a path from the host: '../../etc/cron.d/x' (not relative to the install)", [])


def test_a_source_that_is_not_utf8_is_refused(pb):
    """The probe sends None for a file that is not UTF-8 (probes/facts/host.py): refused, not a crash."""
    facts, findings, sources = host_inputs({"sglang/a.py": "need_sort = a or b\n"})
    sources["sglang/a.py"] = None
    plan = plan_host(pb, "h", {}, facts, findings, sources)
    assert (plan.status, plan.reason, plan.files) == ("failed", "sglang/a.py is not UTF-8 text", [])
