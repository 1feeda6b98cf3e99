"""route-verify-attention on the real triton_backend.py of six SGLang releases: the anchor finding
(probes/facts/verifyroute.py), the playbook's plan through the real planner (the hook module created,
its import and the guard inserted), a second plan that changes nothing, the refusals (an anchor
found twice or never, no deployed kernel, a build the hook would not trust, a server that is not
on triton), the change applied and rolled back by the change probe, and each release's real
extend call run through the guard it gets (a recorder as the hook, the release's own extend_attention_fwd
signature binding the call SGLang makes next).

The releases are the lab's four and two no other test names (0.4.10: sm_scale, logit_cap and its
sliding_window_size positional, which its own signature binds to skip_prefix_custom_mask; 0.5.19:
the 0.5.10 positional k/v scales, page_size/score_mod/aux_tensors keywords, extend_attention_fwd
moved to sglang.kernels.ops), so the finding is judged on code it was not written against.
Each release's files are copied from its wheel (the wheel cache; scripts/setup.sh downloads all
six) into a site-packages tree under tmp_path, as the probe reads an install."""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import json
import os
import textwrap
import zipfile
from pathlib import Path

import pytest

from fleetctl.engine.playbooks.plan import plan_host
from fleetctl.engine.playbooks.model import load_playbook
from fleetctl.probes import buildtrust
from fleetctl.probes.change import actions as change
from fleetctl.probes.facts import scancache, verifyroute
from fleetctl.vocab import PlanStatus
from fleetctl.wheels import ensure_wheel

RELEASES = ["0.4.6.post5", "0.4.10", "0.5.2", "0.5.10", "0.5.19", "0.5.23"]
PLAYBOOK = Path(__file__).resolve().parents[2] / "playbooks" / "route-verify-attention.yaml"
# what each release's extend call passes as its scale and logit cap (read from the wheels)
SCALE_CAP = {"0.4.6.post5": ("layer.scaling", "layer.logit_cap"), "0.4.10": ("layer.scaling", "layer.logit_cap"),
             "0.5.2": ("layer.scaling", "logits_soft_cap"), "0.5.10": ("layer.scaling", "logits_soft_cap"),
             "0.5.19": ("layer.scaling", "logits_soft_cap"), "0.5.23": ("layer.scaling", "logits_soft_cap")}
TORCH = "2.13.0+cpu"


def install(tmp_path: Path, version: str, backend: str | None = None) -> Path:
    """A site-packages dir under tmp_path holding the release's triton_backend.py (or `backend`,
    its text) and the module it imports extend_attention_fwd from."""
    loc = tmp_path / version / "site-packages"
    with zipfile.ZipFile(ensure_wheel(version)) as z:
        names = [n for n in z.namelist() if n.endswith("/extend_attention.py")]
        for rel in [verifyroute.BACKEND] + names:
            p = loc / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(z.read(rel))
    if backend is not None:
        (loc / verifyroute.BACKEND).write_text(backend)
    return loc


@pytest.fixture(autouse=True)
def owners(monkeypatch):
    """The trust walk's owners: root, and this uid where the tests do not run as root (CI runs
    tests/unit as nobody, whose tmp_path is nobody's); a foreign owner is refused as before
    (tests/machine/test_verify_route_hook.py, as root, chowns to another uid)."""
    monkeypatch.setattr(buildtrust, "OWNERS", tuple({0, os.geteuid()}))


def deployed(tmp_path: Path, torch: str = TORCH, location: Path | None = None, table: dict | None = None) -> Path:
    """A public kernels dir (as deploy publishes one: root's, nothing writable by others) whose
    verify_attention `current` names build k1 with PASSED and a build.ninja compiled against a
    torch (version `torch`) in `location` (default: a site-packages of its own), and beside it
    dispatch.json: `table`, default an operator table routing every shape of k1."""
    public = tmp_path / "public"
    key = public / "verify_attention" / "k1"
    (key / "build").mkdir(parents=True)
    module = key / "build" / "verify_attention_cpu.so"
    module.write_bytes(b"")
    (key / "PASSED").write_text(f"{module}\n")
    tdir = (location or tmp_path / "torch-site") / "torch"
    tdir.mkdir(parents=True, exist_ok=True)
    (tdir / "version.py").write_text(f"__version__ = {torch!r}\ncuda = None\n")
    (key / "build" / "build.ninja").write_text(f"cflags = -isystem {tdir}/include/torch/csrc/api/include -isystem "
                                               f"{tdir}/include\n")
    (public / "verify_attention" / "current").symlink_to("k1")
    doc = table if table is not None else {"schema": "fleetctl-dispatch/1", "kernel": "verify_attention",
                                           "build": "k1", "backend": "cpu", "source": "operator", "route": "all",
                                           "all": True, "entries": [], "why": "operator: --route all"}
    (public / "verify_attention" / "dispatch.json").write_text(json.dumps(doc))
    return public


def inputs(loc: Path, version: str, state: Path, servers=()):
    """(facts, findings, sources) of the install at `loc` as gather gives them to the planner."""
    inst = {"id": f"host:{loc}", "sglang": {"location": str(loc), "version": version}, "torch": {"version": TORCH}}
    found = verifyroute.route(inst, [dict(s, install=inst["id"]) for s in servers], str(state), True)
    sources = found.pop("sources")
    facts = {"sglang": {"version": version, "location": str(loc)}, "torch": {"version": TORCH}, "servers": []}
    findings = {"allocator_call_sites": [], "need_sort_origins": [], "verify_attention_route": found,
                "files": found["files"]}
    return facts, findings, sources


def plan(loc, version, state, servers=()):
    return plan_host(load_playbook(PLAYBOOK), "h", {}, *inputs(loc, version, state, servers))


def extend_calls(tree: ast.AST) -> list[ast.Call]:
    """The calls of self.extend_attention_fwd / self._forward_extend_kernel in forward_extend."""
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "forward_extend")
    return [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr in ("extend_attention_fwd", "_forward_extend_kernel")]


@pytest.mark.parametrize("version", RELEASES)
def test_anchor_found_once_and_named_by_the_installed_signature(tmp_path, version):
    loc = install(tmp_path, version)
    text = (loc / verifyroute.BACKEND).read_text()
    found = verifyroute.anchor(str(loc), text)
    a, sig = found["anchor"], found["signature"]
    call = extend_calls(ast.parse(text))
    assert len(call) == 1 and a["line"] == call[0].lineno
    assert a["dropped"] == (1 if version == "0.5.23" else 0)  # _forward_extend_kernel(layer, ...)
    names = [n for n, _ in a["arguments"]]
    assert names[:13] == ["q_extend", "k_extend", "v_extend", "o_extend", "k_buffer", "v_buffer", "qo_indptr",
                          "kv_indptr", "kv_indices", "custom_mask", "is_causal", "mask_indptr", "max_len_extend"]
    assert set(names) <= set(sig["params"]) | set(sig["kwonly"])
    args = dict(a["arguments"])
    assert (args["sm_scale"], args["logit_cap"]) == SCALE_CAP[version]
    assert ("k_scale" in args) == (version in ("0.5.10", "0.5.19", "0.5.23"))
    assert a["returns"] == "o" and found["guard"]["present"] is None and found["import"]["present"] is None


@pytest.mark.parametrize("version", RELEASES)
def test_plan_creates_the_hook_and_guards_the_call_then_is_a_no_op(tmp_path, version):
    loc = install(tmp_path, version)
    state = deployed(tmp_path, location=loc)
    original = (loc / verifyroute.BACKEND).read_text()
    original_bytes = (loc / verifyroute.BACKEND).read_bytes()
    p = plan(loc, version, state)
    assert p.status == PlanStatus.CHANGE, p.reason
    files = {fc.rel: fc for fc in p.files}
    assert [fc.rel for fc in p.files] == [verifyroute.HOOK, verifyroute.BACKEND]  # written before its import
    hook = files[verifyroute.HOOK]
    assert hook.pre_sha256 is None
    imported = [a.name for n in ast.walk(ast.parse(hook.new_text)) if isinstance(n, ast.Import) for a in n.names] + \
        [n.module for n in ast.walk(ast.parse(hook.new_text)) if isinstance(n, ast.ImportFrom)]
    assert imported and not [m for m in imported if m.split(".")[0] == "sglang"]
    assert str(state / "verify_attention" / "current") in hook.new_text
    compile(hook.new_text, verifyroute.HOOK, "exec")
    patched = files[verifyroute.BACKEND].new_text
    compile(patched, verifyroute.BACKEND, "exec")
    tree = ast.parse(patched)
    # the guard sits once, right before the one extend call, and names every argument of it
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "forward_extend")
    guards = [n for n in ast.walk(fn) if isinstance(n, ast.If) and "_fleetctl_verify_fwd" in ast.unparse(n.test)]
    assert len(guards) == 1
    block = next(b for b in (getattr(n, f, None) for n in ast.walk(fn) for f in ("body", "orelse"))
                 if isinstance(b, list) and guards[0] in b)
    call = extend_calls(tree)[0]
    after = block[block.index(guards[0]) + 1]
    assert isinstance(after, ast.Expr) and after.value is call
    hooked = next(n for n in ast.walk(guards[0].test) if isinstance(n, ast.Call)
                  and getattr(n.func, "id", None) == "_fleetctl_verify_fwd")
    assert not hooked.args
    given = {k.arg: ast.unparse(k.value) for k in hooked.keywords}
    dropped = 1 if version == "0.5.23" else 0
    sig = verifyroute.anchor(str(loc), original)["signature"]["params"]
    want = {name: ast.unparse(a) for name, a in zip(sig, call.args[dropped:])}
    want.update({k.arg: ast.unparse(k.value) for k in call.keywords})
    assert given == want
    assert (given["sm_scale"], given["logit_cap"]) == SCALE_CAP[version]
    assert "forward_batch.forward_mode.is_target_verify()" in ast.unparse(guards[0].test)
    assert isinstance(guards[0].body[0], ast.Return) and ast.unparse(guards[0].body[0].value) == "o"
    # the import, once, at module level; without it and the guard, the file is the release's own
    imports = [n for n in tree.body if isinstance(n, ast.Try) and "fleetctl_verify" in ast.unparse(n)]
    assert len(imports) == 1 and ast.unparse(imports[0]) == (
        "try:\n    from sglang.srt.layers.attention.fleetctl_verify import verify_fwd as _fleetctl_verify_fwd\n"
        "except Exception:\n    _fleetctl_verify_fwd = None")
    env = {}  # no hook module here (no sglang at all): the import binds None, never raises
    exec(compile(ast.Module(body=[imports[0]], type_ignores=[]), verifyroute.BACKEND, "exec"), env)
    assert env["_fleetctl_verify_fwd"] is None
    lines = patched.splitlines(True)
    inserted = set(range(imports[0].lineno, imports[0].end_lineno + 1))
    inserted |= set(range(guards[0].lineno, guards[0].end_lineno + 1))
    assert "".join(line for n, line in enumerate(lines, 1) if n not in inserted) == original
    # applied by the change probe, the same playbook plans nothing; rolled back, the release's own
    # file is back byte for byte and the hook module is gone
    ledger_dir = tmp_path / "ledger"
    applied = change.main({"action": "apply", "state_dir": str(ledger_dir), "change_id": "c1", "root": str(loc),
                           "playbook": "route-verify-attention", "operator": "tester",
                           "files": [{"path": fc.path, "pre_sha256": fc.pre_sha256, "post_sha256": fc.post_sha256,
                                      "new_text": fc.new_text} for fc in p.files]})
    assert applied["ok"], applied
    assert (loc / verifyroute.BACKEND).read_text() == patched and (loc / verifyroute.HOOK).is_file()
    again = plan(loc, version, state)
    assert again.status == PlanStatus.OK and again.files == [] and len(again.already_applied) == 3, again.reason
    undone = change.main({"action": "rollback", "state_dir": str(ledger_dir), "last": True})
    assert undone["ok"], undone
    assert (loc / verifyroute.BACKEND).read_bytes() == original_bytes
    assert not os.path.lexists(loc / verifyroute.HOOK)


class Sym:
    """A value standing for the source expression that made it: attributes and calls of it are
    Syms of the longer expression, so what a call passes reads back as its source (repr)."""

    def __init__(self, text: str, **attrs):
        self._text = text
        self.__dict__.update(attrs)

    def __getattr__(self, name: str) -> "Sym":
        if name.startswith("__"):
            raise AttributeError(name)
        return Sym(f"{self._text}.{name}")

    def __call__(self, *args, **kwargs) -> "Sym":
        given = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
        return Sym(f"{self._text}({', '.join(given)})")

    def __repr__(self) -> str:
        return self._text


def _function(source: str, node: ast.FunctionDef, **drop) -> str:
    """`node`'s own source, dedented, decorators and annotations left out."""
    node = ast.parse(textwrap.dedent(ast.get_source_segment(source, node))).body[0]
    node.decorator_list, node.returns = [], None
    for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
        a.annotation = None
    for a in (node.args.vararg, node.args.kwarg):
        if a is not None:
            a.annotation = None
    return ast.unparse(node)


@pytest.mark.parametrize("version", RELEASES)
def test_each_releases_real_call_runs_through_its_guard(tmp_path, version):
    """The patched forward_extend's tail (guard, SGLang's extend call, its return) run with every
    name a Sym, the hook a recorder, and self's extend_attention_fwd the release's own signature
    (its def from the release's extend_attention.py, body dropped) binding what the call passes
    (through 0.5.23's _forward_extend_kernel, its real body): the hook gets exactly those
    arguments, under the names verify_fwd and extend_attention_fwd give them, so sm_scale and
    logit_cap arrive as such; the hook's True returns o with SGLang's kernel not called, False
    runs it, and a batch that is not target verify never reaches the hook."""
    loc = install(tmp_path, version)
    state = deployed(tmp_path, location=loc)
    found = verifyroute.anchor(str(loc), (loc / verifyroute.BACKEND).read_text())
    files = {fc.rel: fc.new_text for fc in plan(loc, version, state).files}
    patched, hook_text = files[verifyroute.BACKEND], files[verifyroute.HOOK]
    tree = ast.parse(patched)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == verifyroute.CLASS)
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == verifyroute.METHOD)
    guard = next(n for n in ast.walk(fn) if isinstance(n, ast.If) and "_fleetctl_verify_fwd" in ast.unparse(n.test))
    block = next(b for n in ast.walk(fn) for b in (getattr(n, "body", None), getattr(n, "orelse", None))
                 if isinstance(b, list) and guard in b)
    tail = block[block.index(guard):block.index(guard) + 3]  # guard, the extend call, return o
    assert isinstance(tail[2], ast.Return)
    lines = patched.splitlines(True)
    body = textwrap.indent(textwrap.dedent("".join(lines[tail[0].lineno - 1:tail[2].end_lineno])), "    ")

    def compiled(source: str, name: str, env: dict):
        exec(compile(source, f"<{version} {name}>", "exec"), env)
        return env[name]

    kernel_src = (loc / found["signature"]["file"]).read_text()
    kernel_def = next(n for n in ast.parse(kernel_src).body
                      if isinstance(n, ast.FunctionDef) and n.name == verifyroute.KERNEL_NAME)
    kernel = inspect.signature(compiled(_function(kernel_src, kernel_def), verifyroute.KERNEL_NAME, {}))
    hook_def = next(n for n in ast.walk(ast.parse(hook_text)) if isinstance(n, ast.FunctionDef)
                    and n.name == "verify_fwd")
    hook_sig = inspect.signature(compiled(_function(hook_text, hook_def), "verify_fwd", {}))
    called = [n.func.attr for n in ast.walk(tail[1]) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
              and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"][0]

    def run(target_verify: bool, served: bool, dllm=None):
        """(what the hook got, what SGLang's kernel got: bound by its signature, the return)."""
        got = {"hook": None, "kernel": None}

        def hook(*args, **kwargs):
            got["hook"] = (args, kwargs)
            return served

        def kernel_fwd(*args, **kwargs):
            got["kernel"] = kernel.bind(*args, **kwargs).arguments

        # 0.5.23's wrapper hands the call to dllm_attention when one is set (not for target verify)
        me = Sym("self", extend_attention_fwd=kernel_fwd, dllm_attention=dllm)
        if called != "extend_attention_fwd":
            wrapper = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == called)
            setattr(me, called, functools.partial(compiled(_function(patched, wrapper), called, {}), me))
        env = {n.id: Sym(n.id) for t in tail for n in ast.walk(t) if isinstance(n, ast.Name)}
        env.update(self=me, _fleetctl_verify_fwd=hook, forward_batch=Sym(
            "forward_batch", forward_mode=Sym("forward_mode", is_target_verify=lambda: target_verify)))
        out = compiled(f"def forward_extend_tail():\n{body}", "forward_extend_tail", env)()
        return got, out

    got, out = run(True, False)
    assert got["hook"] is not None, "a target-verify batch did not reach the hook"
    args, given = got["hook"]
    assert args == () and repr(out) == "o"
    bound = hook_sig.bind(**given).arguments  # the hook takes what it is given, by name
    want = {k: repr(v) for k, v in got["kernel"].items()}
    assert {k: repr(v) for k, v in given.items()} == want
    assert set(buildtrust.NEEDED) <= set(bound["kw"])  # what verify_fwd pulls out of its **kw
    assert (repr(bound["kw"]["sm_scale"]), repr(bound["kw"]["logit_cap"])) == SCALE_CAP[version]
    assert (want["sm_scale"], want["logit_cap"]) == SCALE_CAP[version]
    got, out = run(True, True)
    assert got["kernel"] is None and repr(out) == "o"
    got, out = run(False, True)
    assert got["hook"] is None and got["kernel"] is not None and repr(out) == "o"
    if version == "0.5.23":  # a dllm backend set: the wrapper's own branch runs, the hook never sees the call
        assert found["anchor"]["unless"] == ["self.dllm_attention is not None"]
        got, out = run(True, True, dllm=Sym("dllm"))
        assert got["hook"] is None and got["kernel"] is None and repr(out) == "o"


def test_an_anchor_found_twice_or_never_is_refused(tmp_path):
    version = "0.5.10"
    text = install(tmp_path / "read", version).joinpath(verifyroute.BACKEND).read_text()
    call = extend_calls(ast.parse(text))[0]
    lines = text.splitlines(True)
    stmt = "".join(lines[call.lineno - 1:call.end_lineno])
    twice = text.replace(stmt, stmt + stmt, 1)
    never = text.replace(stmt, stmt.replace("self.extend_attention_fwd(", "self.other_fwd(", 1), 1)
    for mutated, why in ((twice, "reaches extend_attention_fwd 2 times (line %d, line %d), not once"
                          % (call.lineno, call.end_lineno + 1)),
                         (never, "reaches extend_attention_fwd 0 times (no call of self.extend_attention_fwd), not once")):
        loc = install(tmp_path / str(len(mutated)), version, backend=mutated)
        p = plan(loc, version, deployed(tmp_path / str(len(mutated)), location=loc))
        assert p.status == PlanStatus.FAILED and p.files == []
        assert p.reason == "refused: TritonAttnBackend.forward_extend " + why + \
            ": the guard goes before exactly one call"


def test_a_call_passing_a_keyword_the_kernel_does_not_take_is_refused(tmp_path):
    version = "0.5.2"
    text = install(tmp_path / "read", version).joinpath(verifyroute.BACKEND).read_text()
    mutated = text.replace("            xai_temperature_len=layer.xai_temperature_len,\n        )\n        return o",
                           "            xai_temperature_len=layer.xai_temperature_len,\n            page_size=1,\n"
                           "        )\n        return o", 1)
    assert mutated != text
    loc = install(tmp_path, version, backend=mutated)
    p = plan(loc, version, deployed(tmp_path, location=loc))
    assert p.status == PlanStatus.FAILED and "passes page_size=, which extend_attention_fwd" in p.reason


def test_no_kernel_deployed_is_refused_naming_the_command(tmp_path):
    loc = install(tmp_path, "0.5.23")
    p = plan(loc, "0.5.23", tmp_path / "no-state")
    assert p.status == PlanStatus.FAILED and p.files == []
    assert p.reason == (f"refused: verify_attention is not deployed here (no {tmp_path}/no-state/"
                        "verify_attention/current): run `fleetctl deploy kernel verify_attention HOST` first")


def test_a_build_for_another_torch_is_refused(tmp_path):
    loc = install(tmp_path, "0.5.10")
    p = plan(loc, "0.5.10", deployed(tmp_path, torch="2.9.0"))
    assert p.status == PlanStatus.FAILED
    assert "was made with torch 2.9.0 (compiled against" in p.reason and f"this install runs torch {TORCH}" in p.reason
    assert "fleetctl deploy kernel verify_attention HOST` first (with this install's interpreter)" in p.reason


@pytest.mark.parametrize("argv, why", [
    (["--attention-backend", "fa3"], "runs attention backend fa3, not triton"),
    ([], "runs attention backend unset (SGLang's default"),
    (["--prefill-attention-backend", "triton", "--decode-attention-backend", "flashinfer"],
     "runs attention backend triton (prefill) / flashinfer (decode), not triton"),
])
def test_a_server_not_on_the_triton_backend_is_refused(tmp_path, argv, why):
    loc = install(tmp_path, "0.5.23")
    state = deployed(tmp_path, location=loc)
    server = {"pid": 1, "argv": ["python", "-m", "sglang.launch_server", *argv]}
    p = plan(loc, "0.5.23", state, [server])
    assert p.status == PlanStatus.FAILED and p.reason.startswith("refused: server pid 1 " + why), p.reason
    ok = plan(loc, "0.5.23", state, [dict(server, argv=["python", "-m", "sglang.launch_server",
                                                         "--attention-backend", "triton"])])
    assert ok.status == PlanStatus.CHANGE, ok.reason  # pid 1 runs as root


def test_a_server_that_is_not_root_is_planned_the_build_being_public(tmp_path, monkeypatch):
    loc = install(tmp_path, "0.5.23")
    state = deployed(tmp_path, location=loc)
    monkeypatch.setattr(verifyroute, "server", lambda s: {"pid": s["pid"], "uid": 65534, "attention_backend": "triton"})
    p = plan(loc, "0.5.23", state, [{"pid": 7, "argv": []}])
    assert p.status == PlanStatus.CHANGE, p.reason


def _loose(public):
    (public / "verify_attention" / "k1" / "PASSED").chmod(0o666)


def _linked(public):
    (public / "verify_attention" / "k1" / "build" / "extra.so").symlink_to("/etc/passwd")


def _table_link(public):
    t = public / "verify_attention" / "dispatch.json"
    t.rename(public / "t.json")
    t.symlink_to(public / "t.json")


def _outside(public):
    (public / "verify_attention" / "current").unlink()
    (public / "verify_attention" / "current").symlink_to("../k1")


@pytest.mark.parametrize("spoil, why", [
    (_loose, "k1/PASSED is writable by group or others (mode 666)"),
    (_linked, "k1/build/extra.so is a symbolic link"),
    (_table_link, "verify_attention/dispatch.json is a symbolic link"),
    (_outside, "current points at ../k1, not at a build beside it"),
])
def test_a_build_the_hook_would_not_trust_is_refused_by_the_same_walk(tmp_path, spoil, why):
    loc = install(tmp_path, "0.5.23")
    public = deployed(tmp_path, location=loc)
    spoil(public)
    p = plan(loc, "0.5.23", public)
    assert p.status == PlanStatus.FAILED and why in p.reason, p.reason
    assert "the published build is not one the hook would load" in p.reason


TABLE = {"schema": "fleetctl-dispatch/1", "build": "k1", "source": "measured", "all": False,
         "entries": [{"head_dim": 64, "group": 2, "draft_tokens": 4, "dtype": "float32", "max_batch": 8},
                     {"head_dim": 128, "group": 4, "draft_tokens": 4, "dtype": "bfloat16", "max_batch": None}],
         "why": "2 of 6 shapes at least 1.1x faster"}


@pytest.mark.parametrize("change, routes, why_not", [
    ({}, True, None),
    ({"build": "k0"}, False, "is the table of build k0, and current names k1"),
    ({"schema": "other/1"}, False, "is not a fleetctl-dispatch/1 table"),
    ({"entries": []}, False, "enables no shape (source measured: 2 of 6 shapes at least 1.1x faster)"),
    ({"entries": [{"head_dim": 64, "group": 2, "draft_tokens": 4, "dtype": "int8", "max_batch": 8}]}, False,
     "is not {head_dim, group, draft_tokens: int >= 1"),
    ({"all": "yes"}, False, "its all is not true or false"),
])
def test_the_findings_table_says_what_the_hook_routes(tmp_path, change, routes, why_not):
    loc = install(tmp_path, "0.5.23")
    public = deployed(tmp_path, location=loc, table=dict(TABLE, **change))
    k = verifyroute.kernel(str(public), TORCH)
    assert k["active"], k["reason"]  # a table that routes nothing is the route gate's to fail
    t = k["table"]
    assert t["routes"] is routes and t["build_match"] is (change.get("build", "k1") == "k1")
    if routes:
        assert t["shapes"] == ["128:4:4:bfloat16", "64:2:4:float32:8"] and t["why_not"] is None
    else:
        assert why_not in t["why_not"] and t["shapes"] == []


def test_entries_of_one_shape_merge_to_the_largest_batch_and_a_zero_is_no_entry(tmp_path):
    loc = install(tmp_path, "0.5.23")
    e = {"head_dim": 64, "group": 2, "draft_tokens": 4, "dtype": "float32"}

    def table_of(i, entries):
        return verifyroute.kernel(str(deployed(tmp_path / f"t{i}", location=loc, table=dict(TABLE, entries=entries))),
                                  TORCH)["table"]
    for i, (entries, shapes) in enumerate((([dict(e, max_batch=2), dict(e, max_batch=8)], ["64:2:4:float32:8"]),
                                           ([dict(e, max_batch=8), dict(e, max_batch=2)], ["64:2:4:float32:8"]),
                                           ([dict(e, max_batch=2), dict(e, max_batch=None)], ["64:2:4:float32"]))):
        assert table_of(i, entries)["shapes"] == shapes, entries
    for i, zero in enumerate(("head_dim", "group", "draft_tokens", "max_batch"), start=10):
        t = table_of(i, [{**e, "max_batch": 2, zero: 0}])
        assert not t["routes"] and "is not {head_dim, group, draft_tokens: int >= 1" in t["why_not"], zero


def test_no_table_routes_nothing_and_says_so(tmp_path):
    loc = install(tmp_path, "0.5.23")
    public = deployed(tmp_path, location=loc)
    (public / "verify_attention" / "dispatch.json").unlink()
    t = verifyroute.kernel(str(public), TORCH)["table"]
    assert not t["routes"] and t["why_not"].startswith("there is no dispatch table")


def test_a_hook_file_there_already_is_refused_unless_it_is_ours(tmp_path):
    loc = install(tmp_path, "0.5.2")
    (loc / verifyroute.HOOK).write_text("verify_fwd = None\n")
    p = plan(loc, "0.5.2", deployed(tmp_path, location=loc))
    assert p.status == PlanStatus.FAILED and p.reason.startswith(f"{verifyroute.HOOK} exists and is not what")


def test_a_guard_changed_by_hand_is_refused(tmp_path):
    loc = install(tmp_path, "0.5.2")
    state = deployed(tmp_path, location=loc)
    for fc in plan(loc, "0.5.2", state).files:
        Path(fc.path).write_text(fc.new_text)
    backend = loc / verifyroute.BACKEND
    backend.write_text(backend.read_text().replace("sm_scale=layer.scaling", "sm_scale=0.5"))
    p = plan(loc, "0.5.2", state)
    assert p.status == PlanStatus.FAILED and "carries 'fleetctl route-verify-attention' but not the text" in p.reason
    assert hashlib.sha256(backend.read_bytes()).hexdigest() == \
        inputs(loc, "0.5.2", state)[1]["files"][verifyroute.BACKEND]["sha256"]


def test_reinspect_after_the_apply_finds_the_change_in_place(tmp_path):
    """What the gate's reinspect step does after the write: the same plan re-made from the host's
    fresh files has nothing left to do and every planned file has its post-image."""
    from fleetctl.engine.playbooks.plan import reinspect_problems

    loc = install(tmp_path, "0.5.23")
    state = deployed(tmp_path, location=loc)
    p = plan(loc, "0.5.23", state)
    for fc in p.files:
        Path(fc.path).write_text(fc.new_text)
    assert reinspect_problems(load_playbook(PLAYBOOK), p, {}, *inputs(loc, "0.5.23", state)) == []
    Path(p.files[0].path).write_text(Path(p.files[0].path).read_text() + "# later\n")
    assert reinspect_problems(load_playbook(PLAYBOOK), p, {}, *inputs(loc, "0.5.23", state))


def test_an_extend_call_not_passing_what_the_hook_needs_is_refused(tmp_path):
    """A release whose extend_attention_fwd renamed max_len_extend (the real 0.5.2 kernel file,
    renamed) is refused naming it (buildtrust.NEEDED; the hook's side: test_route_hook)."""
    version = "0.5.2"
    loc = install(tmp_path, version)
    kernel = loc / "sglang/srt/layers/attention/triton_ops/extend_attention.py"
    kernel.write_text(kernel.read_text().replace("max_len_extend", "max_extend_len"))
    p = plan(loc, version, deployed(tmp_path, location=loc))
    assert p.status == PlanStatus.FAILED and p.files == []
    assert "the extend call does not pass max_len_extend under the names the hook needs" in p.reason, p.reason


WRAPPER_0523 = '''    def _forward_extend_kernel(self, layer, *args, **kwargs):
        if self.dllm_attention is not None:
            return self.dllm_attention.forward_extend(layer, *args, **kwargs)
        return self.extend_attention_fwd(*args, **kwargs)
'''


@pytest.mark.parametrize("version, old, new, why", [
    ("0.5.2", "torch.compiler.disable(extend_attention_fwd)", "functools.partial(extend_attention_fwd, logit_cap=1.0)",
     "self.extend_attention_fwd is bound to functools.partial(extend_attention_fwd, logit_cap=1.0), not to "
     "extend_attention_fwd as is"),
    ("0.5.2", "torch.compiler.disable(extend_attention_fwd)", "torch.compiler.disable(extend_attention_fwd, "
     "recursive=False)", "is bound to torch.compiler.disable(extend_attention_fwd, recursive=False), not to"),
    ("0.5.23", "        return self.extend_attention_fwd(*args, **kwargs)\n",
     "        kwargs['logit_cap'] = 0.0\n        return self.extend_attention_fwd(*args, **kwargs)\n",
     "TritonAttnBackend._forward_extend_kernel hands *args, **kwargs to the kernel, but not as"),
    ("0.5.23", "if self.dllm_attention is not None:", "if self.dllm_attention is not None or self.busy():",
     "TritonAttnBackend._forward_extend_kernel hands *args, **kwargs to the kernel, but not as"),
    ("0.5.23", "if self.dllm_attention is not None:", "if layer.is_cross_attention:",
     "TritonAttnBackend._forward_extend_kernel hands *args, **kwargs to the kernel, but not as"),
])
def test_a_kernel_binding_or_wrapper_that_could_change_the_call_is_refused(tmp_path, version, old, new, why):
    """What self's kernel attribute binds, or a wrapper's branches, the guard does not see: only
    the bare kernel, torch.compiler.disable(kernel) and early returns on self's state are let in."""
    text = install(tmp_path / "read", version).joinpath(verifyroute.BACKEND).read_text()
    if version == "0.5.23":
        assert WRAPPER_0523 in text
    mutated = text.replace(WRAPPER_0523, WRAPPER_0523.replace(old, new)) if version == "0.5.23" else \
        text.replace(old, new, 1)
    assert mutated != text
    loc = install(tmp_path, version, backend=mutated)
    p = plan(loc, version, deployed(tmp_path, location=loc))
    assert p.status == PlanStatus.FAILED and p.files == [] and why in p.reason, p.reason


def test_an_unknown_torch_version_is_refused_with_its_reason(tmp_path):
    """Issue 49 (case 04): torch's version unknown (a dist-info without metadata, no version.py):
    the refusal says why and what to remove, never "this install runs torch None"."""
    loc = install(tmp_path, "0.5.23")
    public = deployed(tmp_path, location=loc, table=TABLE)
    why = "/x/torch/version.py has no __version__ and no torch dist-info in /x matches the installed files"
    k = verifyroute.kernel(str(public), None, why)
    assert not k["active"] and k["reason"].startswith("this install's torch version cannot be known, so the active "
                                                      "build ") and k["reason"].endswith(": " + why)


def test_the_anchor_is_remembered_and_read_again_when_any_file_it_came_from_changes(tmp_path, monkeypatch):
    """A warm probe takes the anchor from the install's route cache file (found_anchor) instead of
    parsing triton_backend.py again; a change to the backend, to the signature's module, or a
    module file appearing where signature() found none is read again, never answered from the cache."""
    loc = install(tmp_path, "0.5.23")
    module = loc / "sglang" / "kernels" / "ops" / "attention" / "extend_attention.py"
    package = module.with_suffix("")  # the module as a package: signature() passes over a missing extend_attention.py
    package.mkdir()
    module.rename(package / "__init__.py")
    state = deployed(tmp_path)
    inst = {"id": f"host:{loc}", "sglang": {"location": str(loc), "version": "0.5.23",
                                           "package_dir": str(loc / "sglang")}, "torch": {"version": TORCH}}
    store = scancache.Store("k1", str(tmp_path / "cache"))
    calls = []
    anchor = verifyroute.anchor
    monkeypatch.setattr(verifyroute, "anchor", lambda *a: calls.append(a[0]) or anchor(*a))

    def found():
        return verifyroute.route(inst, [], str(state), False, store)

    first = found()
    assert first["refused"] is None and first["signature"]["file"].endswith("extend_attention/__init__.py")
    assert (found(), len(calls)) == (first, 1)  # from the cache
    renamed = (package / "__init__.py").read_text().replace("max_len_extend", "max_extend_len")
    module.write_text(renamed)  # a module file where there was none: signature() now reads it
    assert "max_len_extend" in found()["refused"] and len(calls) == 2
    module.unlink()
    assert (found(), len(calls)) == (first, 3)
    (package / "__init__.py").write_text(renamed)  # the signature's own file changed
    assert "max_len_extend" in found()["refused"] and len(calls) == 4
    assert "max_len_extend" in found()["refused"] and len(calls) == 4  # the refusal is remembered too
    (package / "__init__.py").write_text(renamed.replace("max_extend_len", "max_len_extend"))
    backend = loc / verifyroute.BACKEND
    backend.write_text(backend.read_text() + "\n# changed\n")
    again = found()
    assert len(calls) == 5 and again["files"] != first["files"]
    assert {k: v for k, v in again.items() if k != "files"} == {k: v for k, v in first.items() if k != "files"}
