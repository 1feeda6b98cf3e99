"""The dispatch table (engine/kernels/dispatch.py): --route parsing, the operator and none tables, their
canonical text, what counts as the same routing, the tables as the hook reads them, status's one line; deploy's
activation files (link and table as one change); the kbuild state action and the change
probe's status reading the published tree (no root, no SSH)."""

from __future__ import annotations

import hashlib
import io
import json
import os

import pytest
from rich.console import Console

from fleetctl import config
from fleetctl.report.terminal import render_deploy, render_status
from fleetctl.engine.kernels import deploy, dispatch
from fleetctl.engine.context import HostResult
from fleetctl.errors import EXIT_OPTIONS, HostFailed
from fleetctl.probes import buildtrust
from fleetctl.probes.change import actions as change
from fleetctl.probes.facts import verifyroute
from fleetctl.probes.kernel import state as kernel_state

KEY = "1a2b3c4d5e6f" + "0" * 52


def test_the_public_dir_is_one_path_everywhere():
    assert config.PUBLIC_KERNELS_DIR == change.PUBLIC_DIR == verifyroute.PUBLIC_DIR == "/var/lib/fleetctl-kernels"
    assert deploy.public_paths("verify_attention", KEY) == {
        "root": "/var/lib/fleetctl-kernels/verify_attention",
        "build": f"/var/lib/fleetctl-kernels/verify_attention/{KEY}",
        "link": "/var/lib/fleetctl-kernels/verify_attention/current",
        "table": "/var/lib/fleetctl-kernels/verify_attention/dispatch.json"}


@pytest.mark.parametrize("specs,want", [
    (None, None), ([], None), (["all"], "all"), (["all", "all"], "all"),
    (["64:2:4:float32:8"], ["64:2:4:float32:8"]),
    (["64:2:4:float32:8, 128:4:4:bfloat16", "64:1:2:float16"], ["64:2:4:float32:8", "128:4:4:bfloat16", "64:1:2:float16"]),
])
def test_route_specs(specs, want):
    assert dispatch.parse_route(specs) == want


@pytest.mark.parametrize("specs,said,spec", [
    (["all,64:2:4:float32"], "all routes every shape: it cannot be given with shapes", "all"),
    (["64:2:4"], "'64:2:4': expected all or HEAD_DIM:GROUP:DRAFT_TOKENS:DTYPE[:MAX_BATCH]", "64:2:4"),
    (["64:2:4:float32:8:9"], "'64:2:4:float32:8:9': expected all or", "64:2:4:float32:8:9"),
    (["64:0:4:float32"], "'64:0:4:float32': group must be a positive integer, not '0'", "64:0:4:float32"),
    (["64:2:-4:float32"], "'64:2:-4:float32': draft_tokens must be a positive integer", "64:2:-4:float32"),
    (["64:2:4:float32:x"], "'64:2:4:float32:x': max_batch must be a positive integer, not 'x'", "64:2:4:float32:x"),
    (["64:2:4:fp8"], "'64:2:4:fp8': dtype must be one of float16, bfloat16, float32, not 'fp8'", "64:2:4:fp8"),
    (["64:2:4:float32,"], "an empty shape in '64:2:4:float32,'", None),
    (["64:2:4:float32:8", "64:2:4:float32:16"], "64:2:4:float32:16: the shape 64:2:4:float32:8 is given already",
     "64:2:4:float32:16"),
])
def test_bad_route_specs_are_value_errors_that_name_no_option(specs, said, spec):
    """The engine says why and which spec, never a flag (the CLI and the collection name their own)."""
    with pytest.raises(ValueError) as e:
        dispatch.parse_route(specs)
    assert str(e.value).startswith(said) and "--route" not in str(e.value) and e.value.spec == spec


def test_the_cli_names_the_route_flag_and_the_kernel_task_its_argument(tmp_path):
    """The words the operator sees stay: "--route SPEC: why", "--route: why" for the value as a
    whole (exit 5); the collection's kernel task says "route: ..."."""
    import subprocess
    import sys

    from fleetctl.collection import ops
    from fleetctl.errors import UsageError

    inv = tmp_path / "hosts.yaml"
    inv.write_text("all:\n  hosts:\n    here:\n      ansible_connection: local\n")
    for route, said in (("64:2:4", "--route '64:2:4': expected all or HEAD_DIM:GROUP:DRAFT_TOKENS:DTYPE[:MAX_BATCH]"),
                        ("64:2:4:float32,", "--route: an empty shape in '64:2:4:float32,'")):
        r = subprocess.run([sys.executable, "-m", "fleetctl.cli", "deploy", "kernel", "verify_attention", "all",
                            "--route", route, "-i", str(inv)], capture_output=True, text=True, timeout=60)
        assert (r.returncode, said in " ".join(r.stderr.split())) == (EXIT_OPTIONS, True), (route, r.stderr)
    for route, said in (("64:2:x:float32", "route: '64:2:x:float32': draft_tokens must be a positive integer, not 'x'"),
                        ("64:2:4:float32,", "route: an empty shape in '64:2:4:float32,'")):
        with pytest.raises(UsageError) as e:
            ops.kernel_route(route)
        assert str(e.value) == said


def test_operator_and_none_tables_have_the_designs_shape():
    t = dispatch.operator_table("verify_attention", KEY, "cpu", ["64:2:4:float32:8", "128:4:4:bfloat16"],
                                made="2026-12-02T10:00:00Z")
    assert t == {"schema": "fleetctl-dispatch/1", "kernel": "verify_attention", "build": KEY, "backend": "cpu",
                 "source": "operator", "route": ["64:2:4:float32:8", "128:4:4:bfloat16"], "all": False,
                 "entries": [{"head_dim": 64, "group": 2, "draft_tokens": 4, "dtype": "float32", "max_batch": 8,
                              "speedup": None},
                             {"head_dim": 128, "group": 4, "draft_tokens": 4, "dtype": "bfloat16", "max_batch": None,
                              "speedup": None}],
                 "measured": None, "why": "operator: --route 64:2:4:float32:8,128:4:4:bfloat16",
                 "made": "2026-12-02T10:00:00Z"}
    a = dispatch.operator_table("verify_attention", KEY, "cpu", "all")
    assert (a["source"], a["route"], a["all"], a["entries"]) == ("operator", "all", True, [])
    assert a["made"].endswith("Z") and len(a["made"]) == 20
    n = dispatch.none_table("verify_attention", KEY, "cpu")
    assert (n["source"], n["route"], n["all"], n["entries"], n["why"]) == (
        "none", None, False, [], "no GPU to measure on: nothing routes unless --route all or --route SHAPES")


def test_the_text_is_canonical():
    t = dispatch.operator_table("verify_attention", KEY, "cpu", "all", made="2026-12-02T10:00:00Z")
    text = dispatch.text(t)
    assert text.endswith("}\n") and json.loads(text) == t
    assert dispatch.text(dict(reversed(list(t.items())))) == text  # key order never matters
    keys = [line.split('"')[1] for line in text.splitlines() if line.startswith(' "')]
    assert keys == sorted(keys)


def test_same_routing_ignores_when_and_why_but_nothing_that_routes():
    base = dispatch.operator_table("verify_attention", KEY, "cpu", ["64:2:4:float32:8"], made="2026-12-01T00:00:00Z")
    later = dispatch.operator_table("verify_attention", KEY, "cpu", ["64:2:4:float32:8"], made="2026-12-02T00:00:00Z")
    assert dispatch.same_routing(base, later)
    noted = json.loads(json.dumps(base))
    noted["entries"][0]["speedup"], noted["why"], noted["measured"] = [1.4], "another why", {"device": "x"}
    assert dispatch.same_routing(base, noted)
    for change_ in (lambda t: t.update(build="f" * 64), lambda t: t.update(source="measured"),
                    lambda t: t.update(all=True), lambda t: t.update(backend="cuda"),
                    lambda t: t["entries"][0].update(max_batch=16), lambda t: t["entries"][0].update(dtype="float16"),
                    lambda t: t["entries"].append(dict(t["entries"][0], head_dim=128)),
                    lambda t: t.update(route="all"), lambda t: t.update(schema="fleetctl-dispatch/2")):
        other = json.loads(json.dumps(base))
        change_(other)
        assert not dispatch.same_routing(base, other), other
    assert not dispatch.same_routing(None, base) and not dispatch.same_routing(base, None)
    assert not dispatch.same_routing({"entries": 3}, base)


def _as_the_hook_reads_it(tmp_path, table: dict, key: str = KEY):
    """(all, {shape: max_batch}, why nothing routes) of `table` written as deploy writes it
    (dispatch.text), read by the hook's own reader (probes/buildtrust.py's table: the finding's too)."""
    path = tmp_path / dispatch.FILE
    path.write_text(dispatch.text(table))
    return buildtrust.table(str(path), key)


def test_the_hook_reads_the_tables_deploy_writes(tmp_path):
    t = dispatch.operator_table("verify_attention", KEY, "cpu", ["64:2:4:float32:8", "128:4:4:bfloat16"])
    assert _as_the_hook_reads_it(tmp_path, t) == (False, {(64, 2, 4, "float32"): 8, (128, 4, 4, "bfloat16"): None},
                                                  None)
    assert _as_the_hook_reads_it(tmp_path, t, "f" * 64)[2].endswith(f"is the table of build {KEY}, and current names "
                                                                    + "f" * 64)
    a = dispatch.operator_table("verify_attention", KEY, "cpu", "all")
    assert _as_the_hook_reads_it(tmp_path, a) == (True, {}, None)
    assert "is not a fleetctl-dispatch/1 table" in _as_the_hook_reads_it(tmp_path, dict(a, schema="fleetctl-dispatch/2"))[2]
    none = _as_the_hook_reads_it(tmp_path, dispatch.none_table("verify_attention", KEY, "cpu"))
    assert none[:2] == (False, {}) and f"enables no shape (source none: {dispatch.NO_GPU})" in none[2]


def test_describe_says_what_routes_and_where_it_came_from():
    made = "2026-12-02T10:00:00Z"
    assert dispatch.describe(dispatch.operator_table("v", KEY, "cpu", "all", made=made), KEY) == \
        f"routes all shapes (operator: --route all, {made})"
    assert dispatch.describe(dispatch.operator_table("v", KEY, "cpu", ["64:2:4:float32:8"], made=made), KEY) == \
        f"routes 64:2:4:float32 b<=8 (operator: --route 64:2:4:float32:8, {made})"
    measured = dict(dispatch.operator_table("v", KEY, "cuda", ["64:2:4:float32:8"], made=made), source="measured",
                    route=None, measured={"prefixes": [512, 4096], "min_speedup": 1.1, "shapes": [], "device": "H200"})
    assert dispatch.describe(measured, KEY) == f"routes 64:2:4:float32 b<=8 (measured on H200, >= 1.1x, {made})"
    assert dispatch.describe(dispatch.none_table("v", KEY, "cpu"), KEY) == "routes nothing (no GPU to measure on)"
    assert dispatch.describe(None, KEY) == "routes nothing (no dispatch table)"
    assert dispatch.describe({"error": "x is a symlink"}, KEY) == "routes nothing (dispatch table unreadable: x is a symlink)"
    assert dispatch.describe(dispatch.operator_table("v", "f" * 64, "cpu", "all"), KEY) == \
        "routes nothing (the dispatch table is for build ffffffffffff, not the active one)"


def test_an_activation_is_the_link_and_the_table_in_one_change():
    table = dispatch.operator_table("verify_attention", KEY, "cpu", "all")
    text = dispatch.text(table)
    pub = deploy.public_paths("verify_attention", KEY)
    new = deploy.table_item(pub["table"], None, table)
    assert new == {"path": pub["table"], "pre_sha256": None,
                   "post_sha256": hashlib.sha256(text.encode()).hexdigest(), "new_text": text}
    files = deploy.activation(pub["link"], "f" * 64, KEY, new)
    assert files == [{"path": pub["link"], "kind": "link", "pre_target": "f" * 64, "post_target": KEY}, new]
    # the same key, another table: only the file, over the bytes on the host
    old = {"sha256": "ab" * 32, "text": "{}"}
    only = deploy.activation(pub["link"], KEY, KEY, deploy.table_item(pub["table"], old, table))
    assert [f["path"] for f in only] == [pub["table"]] and only[0]["pre_sha256"] == "ab" * 32
    # the Ansible collection's call (no table): the link alone
    assert deploy.activation("/s/current", None, KEY) == [{"path": "/s/current", "kind": "link", "pre_target": None,
                                                           "post_target": KEY}]
    with pytest.raises(HostFailed, match="the dispatch table is not replaced: .*a symbolic link"):
        deploy.table_item(pub["table"], {"error": "/p/dispatch.json: a symbolic link"}, table)


def test_kbuild_state_reads_the_published_tree(tmp_path):
    pkg = tmp_path / "pub" / "verify_attention"
    (pkg / KEY).mkdir(parents=True)
    os.symlink(KEY, pkg / "current")
    private = tmp_path / "priv" / KEY
    private.mkdir(parents=True)
    hook = tmp_path / "fleetctl_verify.py"
    params = {"link": str(pkg / "current"), "build_dir": str(private), "public_dir": str(pkg / KEY),
              "table": str(pkg / "dispatch.json"), "hook": str(hook)}
    assert kernel_state.state(params) == {"current": KEY, "passed": False, "published": False, "table": None, "hooked": False}
    (pkg / KEY / "PASSED").write_text("x\n")
    (pkg / "dispatch.json").write_text('{"a": 1}\n')
    hook.write_text("")
    got = kernel_state.state(params)
    assert (got["published"], got["hooked"]) == (True, True)
    assert got["table"] == {"sha256": hashlib.sha256(b'{"a": 1}\n').hexdigest(), "text": '{"a": 1}\n'}
    (pkg / "dispatch.json").unlink()
    os.symlink(str(tmp_path / "elsewhere.json"), pkg / "dispatch.json")
    assert "dispatch.json is a symlink, not a regular file" in kernel_state.state(params)["table"]["error"]
    (pkg / "dispatch.json").unlink()
    (pkg / "dispatch.json").write_bytes(b" " * (kernel_state.TABLE_MAX_BYTES + 1))
    assert f"over {kernel_state.TABLE_MAX_BYTES} bytes" in kernel_state.state(params)["table"]["error"]
    assert kernel_state.state(dict(params, hook=None))["hooked"] is False
    # a call that asks for the link and the private build only: only those
    assert kernel_state.state({"link": params["link"], "build_dir": str(private)}) == {"current": KEY, "passed": False}


def test_a_table_on_the_host_that_is_no_json_object_is_no_table():
    t = dispatch.operator_table("verify_attention", KEY, "cpu", "all")
    assert deploy.on_host_table({"sha256": "x", "text": dispatch.text(t)}) == t
    for text in ("[" * 60000, "{not json", "[1]"):  # past the parser's depth, not JSON, not an object
        assert deploy.on_host_table({"sha256": "x", "text": text}) is None
    assert deploy.on_host_table(None) is None and deploy.on_host_table({"error": "a link"}) is None


def test_status_reads_links_and_tables_from_the_public_dir(tmp_path):
    pub, state = tmp_path / "pub", tmp_path / "state"
    state.mkdir()
    (pub / "verify_attention").mkdir(parents=True)
    (pub / "other").mkdir()
    (pub / "broken").mkdir()
    os.symlink(KEY, pub / "verify_attention" / "current")
    os.symlink("k2", pub / "other" / "current")
    os.symlink("k3", pub / "broken" / "current")
    table = dispatch.operator_table("verify_attention", KEY, "cpu", "all")
    (pub / "verify_attention" / "dispatch.json").write_text(dispatch.text(table))
    (pub / "broken" / "dispatch.json").write_text("[1]")
    (pub / "deep").mkdir()
    os.symlink("k4", pub / "deep" / "current")
    (pub / "deep" / "dispatch.json").write_text("[" * 60000)  # past the JSON parser's depth
    # anyone may make a link in route-evidence/ (01777): not a package's
    (pub / "route-evidence").mkdir()
    (pub / "route-evidence").chmod(0o1777)
    os.symlink("forged", pub / "route-evidence" / "current")
    (pub / "route-evidence" / "dispatch.json").write_text(dispatch.text(table))
    # an old layout's link in the state dir is not what status reports any more
    (state / "kernels" / "old").mkdir(parents=True)
    os.symlink("k0", state / "kernels" / "old" / "current")
    r = change.main({"action": "status", "state_dir": str(state), "public_dir": str(pub)})
    assert r["ok"], r
    assert r["kernels"] == {"broken": "k3", "deep": "k4", "other": "k2", "verify_attention": KEY}
    assert "not JSON" in r["dispatch"]["deep"]["error"]
    assert r["dispatch"]["verify_attention"] == table and r["dispatch"]["other"] is None
    assert "not a JSON object" in r["dispatch"]["broken"]["error"]

    out = io.StringIO()
    render_status([HostResult("h1", "a1", "ok", data={**r, "sglang": "0.5.2"})], Console(file=out, width=400))
    text = out.getvalue()
    assert f"verify_attention {KEY[:12]} (cpu): routes all shapes (operator: --route all, {table['made']})" in text
    assert "other k2: routes nothing (no dispatch table)" in text


def test_deploy_check_shows_the_table_it_would_write():
    made = "2026-12-02T10:00:00Z"
    base = {"check": True, "backend": "cpu", "arch": None, "build_key": KEY, "refusals": [], "previous": KEY,
            "reused": True}
    out = io.StringIO()
    render_deploy([HostResult("h1", "a1", "changed", data={
        **base, "table": dispatch.operator_table("v", KEY, "cpu", ["64:2:4:float32:8"], made=made)}),
        HostResult("h2", "a2", "changed", data={**base, "backend": "cuda", "table": None,
                                                "table_note": "measured on the host's GPU by the deploy"})],
        Console(file=out, width=300))
    rows = {line.split("│")[1].strip(): line for line in out.getvalue().splitlines() if line.count("│") > 3}
    assert "would write: routes 64:2:4:float32 b<=8 (operator: --route 64:2:4:float32:8" in rows["h1"]
    assert "measured on the host's GPU by the deploy" in rows["h2"]


def test_a_deploy_switched_back_shows_the_previous_builds_table_as_routing():
    """A failed deploy put the previous build and its table back: data["table"] is that table,
    judged against the previous build (active), not against the key that failed."""
    old = dispatch.operator_table("v", "k-previous", "cpu", "all", made="2026-12-02T10:00:00Z")
    out = io.StringIO()
    render_deploy([HostResult("h1", "a1", "failed", error="switched back to k-previous: route gate failed", data={
        "backend": "cpu", "arch": None, "build_key": KEY, "previous": "k-previous", "reused": True,
        "table": old})], Console(file=out, width=300))
    row = next(line for line in out.getvalue().splitlines() if "h1" in line)
    assert "k-previous" in row and "routes all shapes (operator: --route all" in row, row
    assert "not the active one" not in row


def test_a_table_or_link_the_next_deploy_replaced_is_no_drift(tmp_path):
    """Two activations in a row (link and table, then the same key's new table): status judges
    each file by the latest applied change that wrote over it, so the first is no drift; a hand
    edit of the table is drift of the latest one only."""
    state, root = tmp_path / "state", tmp_path / "pub" / "verify_attention"
    state.mkdir()
    (root / KEY).mkdir(parents=True)
    link, path = str(root / "current"), str(root / "dispatch.json")
    none = deploy.table_item(path, None, dispatch.none_table("verify_attention", KEY, "cpu"))
    r = change.main({"action": "apply", "state_dir": str(state), "change_id": "c1", "root": str(root),
                     "files": deploy.activation(link, None, KEY, none)})
    assert r["ok"], r
    on_host = {"sha256": none["post_sha256"], "text": none["new_text"]}
    routed = deploy.table_item(path, on_host, dispatch.operator_table("verify_attention", KEY, "cpu", "all"))
    r = change.main({"action": "apply", "state_dir": str(state), "change_id": "c2", "root": str(root),
                     "files": deploy.activation(link, KEY, KEY, routed)})
    assert r["ok"] and [f["path"] for f in r["files"]] == [path], r
    st = change.main({"action": "status", "state_dir": str(state), "public_dir": str(tmp_path / "pub")})
    assert st["drift"] == [] and st["dispatch"]["verify_attention"]["all"] is True
    (root / "dispatch.json").write_text("{}\n")
    st = change.main({"action": "status", "state_dir": str(state), "public_dir": str(tmp_path / "pub")})
    assert st["drift"] == [{"change_id": "c2", "path": path, "problem": "drift: edited since the apply"}]
