"""route-verify-attention's hook: its body (playbooks/templates/route-verify-attention/
fleetctl_verify.py, imported directly here), the module the playbook renders from
fleetctl_verify.py.j2 (the body, then probes/buildtrust.py's text, then the host's values), and
buildtrust from both of its sides: the hook, and the verify_attention_route finding
(probes/facts/verifyroute.py, which imports it).

The hook runs over a fake torch (shapes, dtypes and devices only) and a published build whose
module is a Python file standing in for the extension: its entry records what it is called with.
The real CPU build and real tensors: tests/machine/test_verify_route_hook.py. Paths must be
root's for the trust walk; where these tests do not run as root, OWNERS also holds this uid
(the rendered hook's own OWNERS too, set before its last statement, the one that makes
verify_fwd)."""

from __future__ import annotations

import ast
import importlib.util
import itertools
import json
import logging
import os
import sys
import types
from pathlib import Path

import pytest

from fleetctl.engine.playbooks.model import load_playbook
from fleetctl.probes import buildtrust
from fleetctl.probes.facts import verifyroute

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOK = ROOT / "playbooks" / "route-verify-attention.yaml"
BODY = ROOT / "playbooks" / "templates" / "route-verify-attention" / "fleetctl_verify.py"
TORCH = "2.13.0+cpu"
OWNERS = tuple({0, os.geteuid()})
_seq = itertools.count()


LINK = "/var/lib/fleetctl-kernels/verify_attention/current"


def render(link: str = LINK, torch_version: str = TORCH, version: str = "0.5.23") -> str:
    """The hook module as the playbook renders it for a host (plan.py's create_file)."""
    template = next(t for t in load_playbook(PLAYBOOK).tasks if t.name == "the hook module").template
    return template.render({"facts": {"sglang": {"version": version}, "torch": {"version": torch_version}},
                            "findings": {"verify_attention_route": {"kernel": {"link": link}}}}, strip=False)


class Tensor:
    """What verify_fwd reads of a tensor: shape, dtype, device, dim(); `got` is what the build's
    entry was called with when it wrote this one (o_extend)."""

    def __init__(self, *shape, dtype="float32"):
        self.shape, self.dtype = shape, dtype
        self.device = types.SimpleNamespace(type="cpu", index=None)
        self.got = None

    def dim(self) -> int:
        return len(self.shape)


@pytest.fixture
def torch(tmp_path, monkeypatch):
    """A fake torch in sys.modules (what the hook imports): TORCH, installed at tmp_path/torch."""
    fake = types.ModuleType("torch")
    tdir = tmp_path / "torch-site" / "torch"
    tdir.mkdir(parents=True)
    (tdir / "version.py").write_text(f"__version__ = {TORCH!r}\n")  # what the finding reads
    fake.__version__, fake.__file__ = TORCH, str(tdir / "__init__.py")
    fake.float16, fake.bfloat16, fake.float32 = "float16", "bfloat16", "float32"
    fake.Tensor = Tensor
    fake.cuda = types.SimpleNamespace(is_initialized=lambda: False)
    monkeypatch.setitem(sys.modules, "torch", fake)
    # make() registers an exit write and a fork handler per hook: none for these test hooks
    monkeypatch.setattr("atexit.register", lambda *a, **k: None)
    monkeypatch.setattr(os, "register_at_fork", lambda **k: None)
    monkeypatch.setattr(buildtrust, "OWNERS", OWNERS)
    return fake


ENTRY = "def verify_attention_sglang(*args):\n    args[3].got = args\n"


@pytest.fixture
def link(tmp_path, torch) -> Path:
    """PUBLIC/verify_attention/current -> k1, a build (its module a Python file whose entry
    records its call in o_extend) compiled against the fake torch, and a table routing every
    shape of k1, as deploy publishes them (nothing writable by others)."""
    key = tmp_path / "public" / "verify_attention" / "k1"
    (key / "build").mkdir(parents=True)
    module = key / "build" / "verify_attention_cpu.py"
    module.write_text(ENTRY)
    (key / "PASSED").write_text(f"{module}\n")
    tdir = os.path.dirname(torch.__file__)
    (key / "build" / "build.ninja").write_text(f"cflags = -isystem {tdir}/include/torch/csrc/api/include\n")
    (key.parent / "dispatch.json").write_text(json.dumps({"schema": "fleetctl-dispatch/1", "build": "k1",
                                                          "source": "operator", "all": True, "entries": []}))
    (key.parent / "current").symlink_to("k1")
    for p in [tmp_path, *tmp_path.rglob("*")]:
        if not p.is_symlink():
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
    return key.parent / "current"


def from_the_body(link: Path, torch_version: str = TORCH) -> types.ModuleType:
    """The body imported directly (a fresh module), its verify_fwd made over buildtrust itself."""
    spec = importlib.util.spec_from_file_location(f"fleetctl_verify_body_{next(_seq)}", BODY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.verify_fwd = mod.make(str(link), torch_version, buildtrust)
    return mod


def from_the_rendered_file(link: Path, torch_version: str = TORCH) -> types.SimpleNamespace:
    """The rendered hook run statement by statement, its OWNERS set before the last one."""
    tree = ast.parse(render(str(link), torch_version))
    *head, last = tree.body
    assert ast.unparse(last).startswith("verify_fwd = make(_LINK, _TORCH, ")
    ns = {"__name__": f"fleetctl_verify_rendered_{next(_seq)}"}
    exec(compile(ast.Module(head, []), "<rendered hook>", "exec"), ns)
    ns["OWNERS"] = OWNERS
    exec(compile(ast.Module([last], []), "<rendered hook>", "exec"), ns)
    return types.SimpleNamespace(**ns)


SIDES = {"body": from_the_body, "rendered": from_the_rendered_file}


def call(**change):
    """A target-verify call's keywords: batch 2, 4 draft tokens, 8 query heads over 2 KV heads,
    head_dim 64, float32; `change` replaces or adds keywords."""
    kw = {"q_extend": Tensor(8, 8, 64), "k_extend": Tensor(8, 2, 64), "v_extend": Tensor(8, 2, 64),
          "o_extend": Tensor(8, 8, 64), "k_buffer": Tensor(99, 2, 64), "v_buffer": Tensor(99, 2, 64),
          "qo_indptr": Tensor(3), "kv_indptr": Tensor(3), "kv_indices": Tensor(99), "custom_mask": Tensor(64),
          "is_causal": True, "mask_indptr": Tensor(3), "max_len_extend": 4, "sm_scale": 0.125, "logit_cap": 0.0}
    kw.update(change)
    return kw


def test_the_rendered_hook_is_the_body_then_buildtrust_then_this_hosts_values():
    """Both texts go in whole (Jinja reads nothing in them as its own), the body first (its
    docstring is the module's); the template adds the first line, the values and one call."""
    text = render()
    body, trust = BODY.read_text(), Path(buildtrust.__file__).read_text()
    first, _, rest = text.partition("\n")
    assert first == '# fleetctl route-verify-attention: written by fleetctl for SGLang "0.5.23"; its rollback deletes it.'
    assert rest.startswith(body) and rest.count(trust) == 1 and rest.index(trust) > len(body)
    assert ast.get_docstring(ast.parse(text)) == ast.get_docstring(ast.parse(body))
    added = ast.parse(rest.replace(body, "").replace(trust, "")).body
    assert [ast.unparse(n) for n in added] == [
        "import types", f"_LINK = {LINK!r}", f"_TORCH = {TORCH!r}",
        "verify_fwd = make(_LINK, _TORCH, types.SimpleNamespace(NEEDED=NEEDED, Untrusted=Untrusted, walk=walk, "
        "table=table))"]


def test_host_values_in_the_hook_are_data_never_code():
    """The host's SGLang version, torch version and state path, each carrying a line break and
    quotes, change only the hook's _LINK / _TORCH strings and its first-line comment."""

    def parts(version, torch, link):
        text = render(link, torch, version)
        tree = ast.parse(text)
        consts = {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                  and isinstance(n.targets[0], ast.Name) and n.targets[0].id in ("_LINK", "_TORCH")}
        rest = [ast.dump(n) for n in tree.body if not (isinstance(n, ast.Assign) and isinstance(
            n.targets[0], ast.Name) and n.targets[0].id in consts)]
        return consts, rest, text.splitlines()[0]

    evil = "\nimport os; os.system('id')  #\"\"\"'''"
    consts, rest, first = parts("0.5.2" + evil, "2.13.0+cpu" + evil, "/var/lib/fleetctl" + evil + "/current")
    assert consts == {"_TORCH": "2.13.0+cpu" + evil, "_LINK": "/var/lib/fleetctl" + evil + "/current"}
    assert rest == parts("0.5.2", "2.13.0+cpu", "/var/lib/fleetctl/current")[1]
    assert first.startswith("# fleetctl route-verify-attention: written by fleetctl for SGLang \"0.5.2\\nimport os")


def test_the_hook_syncs_nothing_and_allocates_nothing_per_call():
    """An `ast` check of the rendered hook: no .item/.cpu/.tolist/.numpy/.nonzero anywhere, no
    int()/bool() and no float() but of the Python scalar sm_scale in the per-call code, and no
    tensor made or copied there (the call is CUDA-graph captured)."""
    tree = ast.parse(render())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    synced = [ast.unparse(c) for c in calls if isinstance(c.func, ast.Attribute)
              and c.func.attr in ("item", "cpu", "tolist", "numpy", "nonzero")]
    assert synced == []
    per_call = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in (
        "verify_fwd", "_unserved", "_device_ok", "_routed", "_fell")]  # _fell's and _routed's writes are rare
    assert len(per_call) == 5
    made = []
    for fn in per_call:
        for c in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
            name = c.func.id if isinstance(c.func, ast.Name) else c.func.attr if isinstance(c.func, ast.Attribute) else ""
            if name in ("int", "bool") or (name == "float" and ast.unparse(c) != "float(sm_scale)") or name in (
                    "empty", "zeros", "ones", "full", "tensor", "arange", "empty_like", "zeros_like", "cat", "stack",
                    "clone", "contiguous", "to", "copy_", "new_empty"):
                made.append(ast.unparse(c))
    assert made == []
    guard = next(n for n in ast.walk(next(f for f in per_call if f.name == "verify_fwd")) if isinstance(n, ast.If)
                 and "sm_scale is None or type(sm_scale) in _SCALARS" in ast.unparse(n.test))
    assert guard is not None  # float(sm_scale) runs only on a Python scalar


def _defined(tree: ast.Module) -> set[str]:
    """Names a module's top level binds, but imports (the same module bound twice is harmless)."""
    out = set()
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                out |= {x.id for x in ast.walk(t) if isinstance(x, ast.Name)}
    return out


def test_the_body_and_buildtrust_bind_no_name_of_the_other_in_the_one_file():
    """In the rendered hook buildtrust's names are globals beside the body's: one bound by both
    would be the later text's in the body's functions too."""
    body, trust = _defined(ast.parse(BODY.read_text())), _defined(ast.parse(Path(buildtrust.__file__).read_text()))
    assert {"make", "_SERVED"} <= body and {"NEEDED", "OWNERS", "Untrusted", "check", "walk", "table"} <= trust
    assert body & trust == set()
    assert (body | trust) & {"_LINK", "_TORCH", "verify_fwd", "types"} == set()


# the build's entry, verify_attention_sglang (kernels/verify_attention): its tensor arguments, in order
ENTRY_TENSORS = ("q_extend", "k_extend", "v_extend", "o_extend", "k_buffer", "v_buffer", "qo_indptr", "kv_indptr",
                 "kv_indices", "custom_mask", "mask_indptr")


@pytest.mark.parametrize("side", SIDES)
def test_a_served_call_reaches_the_build_each_keyword_in_its_place(link, side):
    """The entry gets the call's tensors in its own order, then the draft width and the scale;
    a call the kernel does not serve never reaches it."""
    hook = SIDES[side](link)
    kw = call()
    want = tuple(kw[n] for n in ENTRY_TENSORS) + (4, 0.125)
    assert hook.verify_fwd(**kw) is True
    assert kw["o_extend"].got == want
    for change in ({"max_len_extend": None}, {"is_causal": False}, {"sinks": Tensor(8)},
                   {"k_buffer": Tensor(99, 2, 64, dtype="bfloat16")}, {"q_extend": Tensor(7, 8, 64)}):
        kw = call(**change)
        assert hook.verify_fwd(**kw) is False and kw["o_extend"].got is None, change


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("name", buildtrust.NEEDED)
def test_a_call_without_a_needed_keyword_falls_back(link, side, name):
    """A release that renamed or dropped one of NEEDED: False, never a TypeError into SGLang;
    the finding refuses such an install (test_verifyroute)."""
    hook = SIDES[side](link)
    kw = call()
    o = kw["o_extend"]
    kw[name + "_renamed"] = kw.pop(name)
    assert hook.verify_fwd(**kw) is False and o.got is None


def _loose(link):
    (link.parent / "k1" / "PASSED").chmod(0o666)
    return "k1/PASSED is writable by group or others (mode 666)"


def _linked(link):
    (link.parent / "k1" / "build" / "extra.so").symlink_to("/etc/passwd")
    return "k1/build/extra.so is a symbolic link"


def _table_link(link):
    t = link.parent / "dispatch.json"
    t.rename(link.parent.parent / "t.json")
    t.symlink_to(link.parent.parent / "t.json")
    return "verify_attention/dispatch.json is a symbolic link"


def _outside(link):
    link.unlink()
    link.symlink_to("../k1")
    return "current points at ../k1, not at a build beside it"


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("spoil", [_loose, _linked, _table_link, _outside])
def test_a_build_the_finding_would_not_call_active_the_hook_does_not_load(link, side, spoil, caplog):
    """The same refusal from the finding (kernel.active false, its reason) and from the hook
    (verify_fwd None, the reason logged once), through the one walk."""
    why = spoil(link)
    found = verifyroute.kernel(str(link.parents[1]), TORCH)
    assert not found["active"] and why in found["reason"], found["reason"]
    with caplog.at_level(logging.WARNING, "fleetctl.verify"):
        assert SIDES[side](link).verify_fwd is None
    assert caplog.text.count("fleetctl route-verify-attention: not routing: ") == 1 and why in caplog.text


@pytest.mark.parametrize("side", SIDES)
def test_a_build_both_trust_is_active_and_loaded_and_the_tables_read_alike(link, side, caplog):
    found = verifyroute.kernel(str(link.parents[1]), TORCH)
    assert found["active"] and found["table"]["routes"], found
    with caplog.at_level(logging.WARNING, "fleetctl.verify"):
        assert SIDES[side](link).verify_fwd is not None
    assert "not routing" not in caplog.text
    # a table for another build: the finding says nothing routes, the hook says so once
    (link.parent / "dispatch.json").write_text(json.dumps({"schema": "fleetctl-dispatch/1", "build": "k0",
                                                           "all": True, "entries": []}))
    found = verifyroute.kernel(str(link.parents[1]), TORCH)["table"]
    assert not found["routes"] and "is the table of build k0, and current names k1" in found["why_not"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, "fleetctl.verify"):
        hook = SIDES[side](link)
    assert f"build k1: nothing is routed: {found['why_not']}" in caplog.text
    kw = call()
    assert hook.verify_fwd(**kw) is False and kw["o_extend"].got is None


@pytest.mark.parametrize("side", SIDES)
def test_a_torch_other_than_the_one_fleetctl_saw_loads_nothing(link, side, caplog):
    with caplog.at_level(logging.WARNING, "fleetctl.verify"):
        assert SIDES[side](link, torch_version="0.0.1").verify_fwd is None
    assert f"torch is {TORCH} here, 0.0.1 when route-verify-attention was applied" in caplog.text
