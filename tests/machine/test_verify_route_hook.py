"""route-verify-attention's hook module (playbooks/templates/route-verify-attention/fleetctl_verify.py.j2:
the body fleetctl_verify.py beside it, then probes/buildtrust.py), rendered as the playbook renders it
and imported, over the run's real CPU build of
kernels/verify_attention (conftest's `cpu_kernel`) laid out as a deploy lays it out
(PUBLIC/verify_attention/{<key>/{PASSED, build/}, `current` -> <key>, dispatch.json}):
routed calls against SGLang 0.5.23's own extend_attention_fwd (bench/gpu_check/carried, run under
TRITON_INTERPRET=1 in a process of its own on the same keywords the hook gets, as the guard passes
them) and against the float64 reference, the fallback matrix (False, `o` untouched), and the
locator's refusals (None, the reason logged). Root: the locator trusts root-owned paths only."""

from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fleetctl.engine.kernels.package import load_package
from fleetctl.engine.playbooks.model import load_playbook

ROOT = Path(__file__).resolve().parents[2]
GPU_CHECK = ROOT / "bench" / "gpu_check"
PKG = load_package(ROOT / "kernels", "verify_attention")
sys.path.insert(0, str(PKG.root))
import test_kernel  # noqa: E402
from reference import tree_mask_from_parents, verify_attention_ref  # noqa: E402
from sglang_layout import target_verify_args  # noqa: E402

PLAYBOOK = load_playbook(ROOT / "playbooks" / "route-verify-attention.yaml")
TEMPLATE = next(t for t in PLAYBOOK.tasks if t.name == "the hook module").template
_seq = itertools.count()

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the hook trusts root-owned builds only: run as root")


def render(link: Path, torch_version: str = torch.__version__) -> str:
    return TEMPLATE.render({"facts": {"sglang": {"version": "0.5.23"}, "torch": {"version": torch_version}},
                            "findings": {"verify_attention_route": {"kernel": {"link": str(link)}}}}, strip=False)


def hook(tmp_path: Path, link: Path, torch_version: str = torch.__version__):
    """The rendered hook imported as a fresh module: its verify_fwd (None or the function)."""
    path = tmp_path / f"fleetctl_verify_{next(_seq)}.py"
    path.write_text(render(link, torch_version))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.verify_fwd


ENTRIES = [{"head_dim": 64, "group": g, "draft_tokens": t, "dtype": d, "max_batch": 4}
           for g in (1, 8) for t in (1, 4, 8) for d in ("float32", "bfloat16")]


def table(entries, every=False, build="k1") -> str:
    """A dispatch.json (engine/kernels/dispatch.py's schema) for `build`."""
    return json.dumps({"schema": "fleetctl-dispatch/1", "kernel": "verify_attention", "build": build,
                       "backend": "cpu", "source": "measured", "all": every, "entries": entries,
                       "why": "a test's table"})


@pytest.fixture
def state(tmp_path, cpu_kernel):
    """A public kernels dir as a deploy leaves it, holding a copy of the run's CPU build and a
    dispatch table enabling ENTRIES: its `current` link."""
    built = Path(cpu_kernel[3]["module_path"])
    key = tmp_path / "public" / "verify_attention" / "k1"
    key.mkdir(parents=True)
    shutil.copytree(built.parent, key / "build", ignore=shutil.ignore_patterns("*.o", "lock"))
    (key / "PASSED").write_text(f"{key / 'build' / built.name}\n")
    (key.parent / "dispatch.json").write_text(table(ENTRIES))
    link = key.parent / "current"
    link.symlink_to("k1")
    for p in [tmp_path, *tmp_path.rglob("*")]:
        if not p.is_symlink():
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
    (tmp_path / "public" / "route-evidence").mkdir()
    os.chmod(tmp_path / "public" / "route-evidence", 0o755)  # as kbuild's publish makes it (evidence.py)
    return link


def call_args(B, T, prefixes, G, dtype, mask="bool", parents=None, seed=0):
    """(extend_attention_fwd keywords of a target-verify call, the reference output)."""
    gen = torch.Generator().manual_seed(seed)
    x = test_kernel.make_inputs(B, T, prefixes, 1, G, 64, dtype, "cpu", gen)
    if parents is not None:
        x["tree_mask"] = tree_mask_from_parents(parents).unsqueeze(0).expand(B, T, T).contiguous()
    a = target_verify_args(x, mask=mask)
    kw = {"q_extend": a["q"], "k_extend": a["k_extend"], "v_extend": a["v_extend"], "o_extend": a["o"],
          "k_buffer": a["k_buffer"], "v_buffer": a["v_buffer"], "qo_indptr": a["qo_indptr"],
          "kv_indptr": a["kv_indptr"], "kv_indices": a["kv_indices"], "custom_mask": a["custom_mask"],
          "is_causal": True, "mask_indptr": a["mask_indptr"], "max_len_extend": a["T"], "k_scale": 1.0,
          "v_scale": 1.0, "sm_scale": a["sm_scale"], "logit_cap": 0.0, "sliding_window_size": -1, "sinks": None,
          "window_kv_offsets": None, "xai_temperature_len": -1, "page_size": 1, "score_mod": None,
          "aux_tensors": None, "extend_seq_lens_cpu": [T] * B}
    return kw, verify_attention_ref(**x)


ROUTED = [  # (T, G, prefix per request: ragged, mask layout, draft parents, other keywords)
    (1, 1, [0, 1], "bool", None, {}),
    (4, 8, [37, 0], "bool", [-1, 0, 0, 1], {}),      # a tree
    (4, 1, [1, 12, 0], "uint8", [-1, 0, 1, 2], {}),  # the graph-buffer mask layout
    (8, 8, [5, 2], None, list(range(-1, 7)), {}),     # no mask: the causal chain
    # a tree in the graph-buffer layout; SGLang 0.4.10's call passes its sliding_window_size (-1)
    # positionally into skip_prefix_custom_mask, which its kernel reads as a truth value
    (8, 8, [1, 0, 64], "uint8", [-1, 0, 0, 1, 1, 2, 3, 5], {"skip_prefix_custom_mask": -1}),
]


def routed_args(case: int):
    """call_args of ROUTED[case]."""
    T, G, prefixes, mask, parents, other = ROUTED[case]
    kw, want = call_args(len(prefixes), T, prefixes, G, torch.float32, mask, parents)
    return dict(kw, **other), want


# SGLang's kernel on the calls: its o_extend a NaN tensor of its own, every other keyword the hook's
SGLANG_RUN = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import interp_shims
interp_shims.apply()
from carried.extend_attention import extend_attention_fwd
outs = []
for kw in torch.load(sys.argv[2]):
    o = torch.full_like(kw["o_extend"], float("nan"))
    extend_attention_fwd(**dict(kw, o_extend=o))
    outs.append(o)
torch.save(outs, sys.argv[3])
"""


@pytest.fixture(scope="module")
def sglang_outputs(tmp_path_factory):
    """SGLang 0.5.23's extend_attention_fwd (carried) on each ROUTED call, under TRITON_INTERPRET=1
    (chosen before triton is imported, hence a process of its own): [o_extend]."""
    d = tmp_path_factory.mktemp("sglang-kernel")
    torch.save([routed_args(case)[0] for case in range(len(ROUTED))], d / "calls.pt")
    r = subprocess.run([sys.executable, "-c", SGLANG_RUN, str(GPU_CHECK), str(d / "calls.pt"), str(d / "outs.pt")],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stderr[-4000:]
    return torch.load(d / "outs.pt")


@pytest.mark.parametrize("case", range(len(ROUTED)), ids=[f"T{c[0]}-G{c[1]}-P{'.'.join(map(str, c[2]))}-{c[3]}"
                                                          f"{'-' + '-'.join(c[5]) if c[5] else ''}" for c in ROUTED])
def test_a_listed_shape_is_routed_and_matches_sglang_and_the_reference(tmp_path, state, sglang_outputs, case):
    fwd = hook(tmp_path, state)
    assert fwd is not None
    kw, want = routed_args(case)
    o = kw["o_extend"]
    assert fwd(**kw) is True
    assert kw["o_extend"] is o  # written in place
    atol, rtol = PKG.tolerances["float32"]
    theirs = sglang_outputs[case]
    assert bool(theirs.isfinite().all())  # SGLang's kernel wrote every row
    torch.testing.assert_close(o, theirs, atol=atol, rtol=rtol)
    torch.testing.assert_close(o.double(), want, atol=atol, rtol=rtol)


class NoHostRead(torch.overrides.TorchFunctionMode):
    """Raises on any tensor method that reads a value to the host (a sync on a GPU), implicit
    truth values and int()/float()/index of a tensor included (what an `ast` check cannot see)."""

    READS = {"item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__", "__len__"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            raise AssertionError(f"host read of a tensor value: {func.__name__}")
        return func(*args, **(kwargs or {}))


def test_a_routed_call_reads_no_tensor_value(tmp_path, state, caplog):
    """Each ROUTED call under NoHostRead: still routed (a host read would raise inside the hook,
    which would then log it and return False)."""
    fwd = hook(tmp_path, state)
    for case in range(len(ROUTED)):
        kw, _ = routed_args(case)
        with caplog.at_level(logging.WARNING, "fleetctl.verify"), NoHostRead():
            routed = fwd(**kw)
        assert routed is True, caplog.text


SINKS = torch.zeros(8)


@pytest.mark.parametrize("change", [
    {"sinks": SINKS}, {"sliding_window_size": 128}, {"logit_cap": 30.0}, {"k_scale": torch.tensor(0.5)},
    {"v_scale": 0.5}, {"page_size": 2}, {"score_mod": print}, {"window_kv_offsets": SINKS},
    {"xai_temperature_len": 8}, {"skip_prefix_custom_mask": False}, {"skip_prefix_custom_mask": 0},
    {"skip_prefix_custom_mask": None}, {"a_new_keyword": 1}, {"is_causal": False},
    {"max_len_extend": 3},                      # not in the dispatch table
    {"sm_scale": torch.tensor(0.125)},          # a tensor scale: float() of it would sync
    "ragged", "bf16_kv_for_fp32_q", "three_requests_for_max_batch_2",
    "max_len_extend_renamed", "mask_indptr_left_out",  # a release that renamed / dropped a keyword
])
def test_what_the_kernel_does_not_serve_falls_back_with_o_untouched(tmp_path, state, change):
    fwd = hook(tmp_path, state)
    kw, _ = call_args(2, 4, [9, 3], 8, torch.float32)
    if change == "ragged":  # draft widths 4 and 3: q holds 7 rows, max_len_extend 4
        kw.update(q_extend=kw["q_extend"][:7], o_extend=kw["o_extend"][:7], k_extend=kw["k_extend"][:7],
                  v_extend=kw["v_extend"][:7])
    elif change == "bf16_kv_for_fp32_q":  # an fp8/bf16 KV cache under other queries
        kw["k_buffer"] = kw["k_buffer"].to(torch.bfloat16)
    elif change == "max_len_extend_renamed":  # verify_fwd(**kw) never raises TypeError into SGLang
        kw["max_extend_len"] = kw.pop("max_len_extend")
    elif change == "mask_indptr_left_out":
        del kw["mask_indptr"]
    elif change == "three_requests_for_max_batch_2":
        (state.parent / "dispatch.json").write_text(table([dict(ENTRIES[4], max_batch=1)]))
        fwd = hook(tmp_path, state)
    else:
        kw.update(change)
    before = kw["o_extend"].clone()
    assert fwd(**kw) is False
    assert torch.equal(kw["o_extend"].isnan(), before.isnan()) and torch.equal(kw["o_extend"].nan_to_num(),
                                                                               before.nan_to_num())


@pytest.mark.parametrize("spoil, why", [
    (None, "there is no dispatch table"),
    (table(ENTRIES, build="k0"), "is the table of build k0, and current names k1"),
    (table([]), "enables no shape (source measured: a test's table)"),
    ("{", "cannot be read: JSONDecodeError"),
    (json.dumps({"entries": ENTRIES}), "is not a fleetctl-dispatch/1 table"),
])
def test_no_table_or_one_not_for_this_build_routes_nothing(tmp_path, state, caplog, spoil, why):
    t = state.parent / "dispatch.json"
    t.unlink()
    if spoil is not None:
        t.write_text(spoil)
    with caplog.at_level(logging.WARNING, "fleetctl.verify"):
        fwd = hook(tmp_path, state)
    assert fwd is not None and "build k1: nothing is routed: " in caplog.text and why in caplog.text, caplog.text
    kw, _ = call_args(2, 4, [9, 3], 8, torch.float32)
    assert fwd(**kw) is False


def test_an_all_table_routes_every_shape_and_any_batch(tmp_path, state):
    (state.parent / "dispatch.json").write_text(table([], every=True))
    fwd = hook(tmp_path, state)
    kw, _ = call_args(7, 4, [9, 3, 1, 5, 2, 8, 4], 2, torch.float32)  # group 2, batch 7: in no entry
    assert fwd(**kw) is True


def _refused(tmp_path, link, caplog, torch_version=torch.__version__) -> str:
    caplog.clear()
    with caplog.at_level(logging.WARNING, "fleetctl.verify"):
        assert hook(tmp_path, link, torch_version) is None
    return caplog.text


def test_the_locator_refuses_what_it_cannot_trust(tmp_path, state, caplog):
    key = state.parent / "k1"
    os.chmod(key / "build", 0o775)
    assert f"{key / 'build'} is writable by group or others (mode 775)" in _refused(tmp_path, state, caplog)
    os.chmod(key / "build", 0o755)
    os.chown(key / "PASSED", 65534, 0)
    assert f"{key / 'PASSED'} belongs to uid 65534, not root" in _refused(tmp_path, state, caplog)
    os.chown(key / "PASSED", 0, 0)
    os.chmod(state.parent, 0o757)
    assert "writable by group or others (mode 757)" in _refused(tmp_path, state, caplog)
    os.chmod(state.parent, 0o755)
    t = state.parent / "dispatch.json"  # the table: as trusted as the build
    os.chmod(t, 0o666)
    assert f"{t} is writable by group or others (mode 666)" in _refused(tmp_path, state, caplog)
    os.chmod(t, 0o644)
    t.rename(tmp_path / "table.json")
    t.symlink_to(tmp_path / "table.json")
    assert f"{t} is a symbolic link" in _refused(tmp_path, state, caplog)
    t.unlink()
    (tmp_path / "table.json").rename(t)
    # `current` through another link, or out of the package directory
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(key, elsewhere, symlinks=True)
    state.unlink()
    state.symlink_to(elsewhere)
    assert f"{state} points at {elsewhere}, not at a build beside it" in _refused(tmp_path, state, caplog)
    state.unlink()
    (state.parent / "k2").symlink_to(elsewhere)
    state.symlink_to("k2")
    assert f"{state.parent / 'k2'} is a symbolic link" in _refused(tmp_path, state, caplog)
    state.unlink()
    state.symlink_to("gone")
    assert f"{state} points at gone, which is not there" in _refused(tmp_path, state, caplog)
    state.unlink()
    state.symlink_to("k1")
    (key / "PASSED").write_text(f"{elsewhere / 'build' / 'verify_attention_cpu.so'}\n")
    assert "not a module in" in _refused(tmp_path, state, caplog)
    (key / "PASSED").write_text(f"{key / 'build' / 'verify_attention_cpu.so'}\n")
    text = _refused(tmp_path, state, caplog, torch_version="0.0.1")
    assert f"torch is {torch.__version__} here, 0.0.1 when route-verify-attention was applied" in text
    ninja = key / "build" / "build.ninja"
    ninja.write_text(ninja.read_text().replace(os.path.dirname(torch.__file__), "/opt/other/torch"))
    assert "was not compiled against this process's torch" in _refused(tmp_path, state, caplog)


def test_import_makes_no_cuda_call_and_loads_the_module_at_the_first_routed_call(tmp_path, state):
    path = tmp_path / "fleetctl_verify_probe.py"
    path.write_text(render(state))
    # every torch.cuda entry the hook could reach raises: importing must not touch one
    code = ("import sys, torch, importlib.util\n"
            "def boom(*a, **k): raise AssertionError('CUDA called')\n"
            "for n in ('is_available', 'init', 'current_device', 'get_device_capability', 'device_count'):\n"
            "    setattr(torch.cuda, n, boom)\n"
            f"spec = importlib.util.spec_from_file_location('h', {str(path)!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "assert m.verify_fwd is not None\n"
            "print(sorted(n for n in sys.modules if n.startswith('verify_attention')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"  # the build's module is not loaded yet


def test_a_failing_call_is_logged_once_per_exception_type(tmp_path, state, caplog):
    """Per-call errors whose messages differ (they name shapes) log once, by exception type."""
    fwd = hook(tmp_path, state)

    class Indptr:
        def __init__(self, n):
            self.n = n

        @property
        def shape(self):
            raise ValueError(f"no shape for a batch of {self.n}")

    with caplog.at_level(logging.WARNING, "fleetctl.verify"):
        for n in (2, 3, 4):
            kw, _ = call_args(2, 4, [9, 3], 8, torch.float32)
            assert fwd(**dict(kw, qo_indptr=Indptr(n))) is False
    assert caplog.text.count("a call fell back: ValueError: no shape for a batch of") == 1, caplog.text
