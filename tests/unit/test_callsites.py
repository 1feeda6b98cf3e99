"""The remote AST scanner (fleetctl.probes.facts.callsites) on real SGLang releases and on synthetic trees.

Real facts below were read by hand from the unpacked wheels; an independent, deliberately
plain AST reading (every file, ast.walk, no substring filter, no scopes) must agree with the
scanner on every (file, line) of every release.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

from fleetctl.probes.facts import callsites
from fleetctl.wheels import ensure_wheel
from oracles import independent

RELEASES = ["0.4.6.post5", "0.5.2", "0.5.10", "0.5.23"]
@pytest.fixture(scope="module")
def trees(tmp_path_factory) -> dict[str, Path]:
    """{release: site-packages-like dir holding that wheel's sglang/*.py}."""
    out = {}
    for v in RELEASES:
        d = tmp_path_factory.mktemp("sp-" + v)
        with zipfile.ZipFile(ensure_wheel(v)) as z:
            z.extractall(d, [n for n in z.namelist() if n.startswith("sglang/") and n.endswith(".py")])
        out[v] = d
    return out


@pytest.fixture(scope="module")
def scans(trees) -> dict[str, dict]:
    return {v: callsites.main({"location": str(d)}) for v, d in trees.items()}


def _sites(r, file=None):
    return {(s["file"], s["line"]): s for s in r["allocator_call_sites"] if file in (None, s["file"])}


def _origins(r, file=None):
    return {(o["file"], o["line"]): o for o in r["need_sort_origins"] if file in (None, o["file"])}


# ---- independent reading --------------------------------------------------------------

@pytest.mark.releases
@pytest.mark.parametrize("version", RELEASES)
def test_matches_independent_reading(trees, scans, version):
    direct, aliased, origins = independent(trees[version])
    r = scans[version]
    assert {k for k, s in _sites(r).items() if not s["aliased"]} == direct
    assert {k for k, s in _sites(r).items() if s["aliased"]} == aliased
    assert set(_origins(r)) == origins
    assert direct  # every release has allocator calls
    assert r["parse_errors"] == []


# ---- real facts, read by hand -----------------------------------------------------------

@pytest.mark.releases
def test_0_4_6_has_no_need_sort(scans):
    r = scans["0.4.6.post5"]
    assert r["need_sort_origins"] == []
    f = "sglang/srt/model_executor/model_runner.py"
    sites = _sites(r)
    assert set(sites) == {(f, 960), (f, 967)}
    assert {s["callee"] for s in sites.values()} == {"TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator"}
    assert all(s["need_sort"]["passing"] == "absent" and s["need_sort"]["expr"] is None for s in sites.values())
    assert set(r["files"]) == {f}


@pytest.mark.releases
def test_0_5_2_positional_and_keyword(scans):
    r = scans["0.5.2"]
    mr, alloc = "sglang/srt/model_executor/model_runner.py", "sglang/srt/mem_cache/allocator.py"
    sites = _sites(r)
    # SWATokenToKVPoolAllocator.__init__ builds its two sub-allocators positionally.
    for line in (191, 198):
        assert sites[(alloc, line)]["need_sort"] == {
            "passing": "positional", "expr": "need_sort",
            "resolved": alloc + "::TokenToKVPoolAllocator"}
    for line in (1483, 1494, 1503, 1512):
        assert sites[(mr, line)]["need_sort"] == {"passing": "keyword", "expr": "need_sort"}
    o = _origins(r)[(mr, 1480)]
    assert (o["kind"], o["target"], o["literal"]) == ("assignment", "need_sort", False)
    assert o["expr"] == 'self.server_args.disaggregation_mode in ("decode", "prefill")'
    assert (alloc, 52) not in _origins(r)  # self.need_sort = need_sort only stores the value


@pytest.mark.releases
def test_0_5_10_mixin(scans):
    r = scans["0.5.10"]
    mixin = "sglang/srt/model_executor/model_runner_kv_cache_mixin.py"
    sites = _sites(r, mixin)
    assert sorted(line for _, line in sites) == [728, 742, 752, 769, 780, 788]
    s = sites[(mixin, 728)]
    assert (s["end_line"], s["callee"], s["aliased"]) == (736, "SWATokenToKVPoolAllocator", False)
    assert all(s["need_sort"] == {"passing": "keyword", "expr": "need_sort"} for s in sites.values())
    o = _origins(r)[(mixin, 721)]
    assert (o["kind"], o["callee"], o["literal"], o["stmt_end_line"]) == ("assignment", None, False, 721)
    # literal origin in the MLX stub
    stub = _origins(r)[("sglang/srt/hardware_backend/mlx/model_runner_stub.py", 159)]
    assert (stub["kind"], stub["callee"], stub["expr"], stub["literal"]) == (
        "keyword", "TokenToKVPoolAllocator", "False", True)
    # swa_memory_pool: a class alias chosen by if/elif/else, need_sort passed positionally
    swa = _sites(r, "sglang/srt/mem_cache/swa_memory_pool.py")
    for line in (271, 279):
        s = swa[("sglang/srt/mem_cache/swa_memory_pool.py", line)]
        assert s["aliased"] and s["callee"] == "PagedTokenToKVPoolAllocatorClass"
        assert s["alias_of"] == ["NPUPagedTokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator"]
        assert (s["need_sort"]["passing"], s["need_sort"]["expr"]) == ("positional", "need_sort")


@pytest.mark.releases
def test_0_5_23_configurator(trees, scans):
    r = scans["0.5.23"]
    kc = "sglang/srt/mem_cache/kv_cache_configurator.py"
    computed = 'get_disagg().disaggregation_mode in ("decode", "prefill")'
    origins = _origins(r, kc)
    assert {k[1]: (o["kind"], o["callee"]) for k, o in origins.items()} == {
        932: ("keyword", "init_unified_mamba_pools"),
        1025: ("keyword", "init_unified_mamba_swa_pools"),
        1511: ("keyword", "init_unified_swa_pools"),
        2805: ("assignment", None)}
    assert all(o["expr"] == computed and not o["literal"] for o in origins.values())
    # spans replace exactly the value text
    lines = (trees["0.5.23"] / kc).read_text().splitlines()
    for o in origins.values():
        assert lines[o["value_line"] - 1][o["value_col"]:o["value_end_col"]] == computed
    sites = _sites(r, kc)
    assert sites[(kc, 2823)]["alias_of"] == ["DSV4NPUTokenToKVPoolAllocator", "SWATokenToKVPoolAllocator"]
    assert sites[(kc, 2929)]["callee"] == "paged_allocator_cls" and sites[(kc, 2929)]["aliased"]
    assert sites[(kc, 2941)]["need_sort"]["passing"] == "absent"  # DeepSeekV4HiSparse wraps an allocator
    assert len(sites) == 9 and sum(s["need_sort"]["passing"] == "keyword" for s in sites.values()) == 8
    literal = {k for k, o in _origins(r).items() if o["literal"]}
    assert literal == {("sglang/srt/hardware_backend/mlx/model_runner_stub.py", 324),
                       ("sglang/srt/mem_cache/pool_host/page_interleave.py", 65)}
    hs = _sites(r, "sglang/srt/mem_cache/allocator/hisparse.py")
    assert {k[1]: s["need_sort"]["expr"] for k, s in hs.items()} == {
        47: "need_sort", 55: "need_sort", 329: "logical_attn_allocator.need_sort"}
    assert all(s["need_sort"]["resolved"] == "sglang/srt/mem_cache/allocator/paged.py::PagedTokenToKVPoolAllocator"
               for s in hs.values())
    assert not any(f.startswith("sglang/test/") for f in r["files"])  # sglang/test holds need_sort=False
    data = (trees["0.5.23"] / kc).read_bytes()
    assert r["files"][kc] == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    assert r["stats"]["files_parsed"] < r["stats"]["files_total"] / 20  # the substring filter works


def test_output_is_json_and_sorted(tmp_path, capfd):
    """The probe's stdout is its JSON channel: scanning prints nothing, even on a parse error."""
    loc = make_tree(tmp_path, {"nest.py": NESTED, "bad.py": "need_sort = (\n", "use.py": ALLOC})
    capfd.readouterr()
    r = callsites.main({"location": str(loc)})
    assert capfd.readouterr() == ("", "")
    assert json.loads(json.dumps(r)) == r and r["parse_errors"]
    for key in ("allocator_call_sites", "need_sort_origins"):
        keys = [(d["file"], d["line"], d["col"]) for d in r[key]]
        assert keys == sorted(keys) and len(keys) > 5


PROBES = Path(callsites.__file__).parents[1]  # agent/fleetctl/probes: every room


@pytest.mark.parametrize("probe", sorted(str(p.relative_to(PROBES)) for p in PROBES.rglob("*.py")
                                          if p.name != "__init__.py"))
def test_probe_is_stdlib_py38(probe):
    """Every probe module, in every room of probes/, parses as Python 3.8 and imports only the
    stdlib and other probes (`from . import x`); none prints (stdout carries the result)."""
    src = (PROBES / probe).read_text()
    tree = ast.parse(src, feature_version=(3, 8))
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
    assert mods <= sys.stdlib_module_names
    assert "print(" not in src


# ---- synthetic trees ----------------------------------------------------------------------

def make_tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / "sglang" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text), encoding="utf-8")
    return tmp_path


ALLOC = """\
class BaseTokenToKVPoolAllocator:
    def __init__(self, size, page_size, need_sort: bool = False):
        self.need_sort = need_sort

class PagedTokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    pass

class TokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    def __init__(self, size, dtype, *, kv=None):
        pass

class PlainTokenToKVPoolAllocator(Plain):
    pass

class CycleTokenToKVPoolAllocator(LoopTokenToKVPoolAllocator):
    pass

class LoopTokenToKVPoolAllocator(CycleTokenToKVPoolAllocator):
    pass
"""


def test_synthetic_call_sites(tmp_path):
    loc = make_tree(tmp_path, {
        "alloc.py": ALLOC,
        "plain.py": "class Plain:\n    def __init__(self, a, b):\n        pass\n",
        "npu.py": """\
            from . import alloc
            class PagedTokenToKVPoolAllocator(alloc.PagedTokenToKVPoolAllocator):
                pass
            x = PagedTokenToKVPoolAllocator(1, 2, True)
            y = CycleTokenToKVPoolAllocator(1, 2, True)
            """,
        "use.py": """\
            from .alloc import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator as TA
            a = PagedTokenToKVPoolAllocator(
                size,
                page_size=1,
                need_sort=flag,
            )
            b = PagedTokenToKVPoolAllocator(1, 2, x or y)
            c = PagedTokenToKVPoolAllocator(1, 2)
            d = TA(1, 2, **kw)
            e = UnknownTokenToKVPoolAllocator(1)
            f = PlainTokenToKVPoolAllocator(1, 2)

            def build(flag):
                cls = PagedTokenToKVPoolAllocator if flag else mod.NPUPagedTokenToKVPoolAllocator
                return cls(1, 2, need_sort=True)

            def other(cls):
                return cls(1)
            """})
    r = callsites.scan(str(loc))
    s = {x["line"]: x for x in r["allocator_call_sites"] if x["file"] == "sglang/use.py"}
    assert sorted(s) == [2, 7, 8, 9, 10, 11, 15]
    assert (s[2]["end_line"], s[2]["col"], s[2]["end_col"]) == (6, 4, 1)
    assert s[2]["need_sort"] == {"passing": "keyword", "expr": "flag"}
    base = "sglang/alloc.py::BaseTokenToKVPoolAllocator"  # inherited __init__
    assert s[7]["need_sort"] == {"passing": "positional", "expr": "x or y", "resolved": base}
    assert s[8]["need_sort"] == {"passing": "default", "expr": None, "resolved": base}
    assert s[9]["aliased"] and s[9]["alias_of"] == ["TokenToKVPoolAllocator"] and s[9]["callee"] == "TA"
    assert s[9]["need_sort"] == {"passing": "absent", "expr": None, "kwargs": True,
                                 "resolved": "sglang/alloc.py::TokenToKVPoolAllocator"}
    assert s[10]["need_sort"] == {"passing": "absent", "expr": None, "resolved": None}
    # base class defined in a file the substring filter skipped: parsed on demand
    assert s[11]["need_sort"]["resolved"] == "sglang/plain.py::Plain"
    assert s[15]["aliased"] and s[15]["callee"] == "cls"
    assert s[15]["alias_of"] == ["PagedTokenToKVPoolAllocator", "NPUPagedTokenToKVPoolAllocator"]
    assert set(r["files"]) == {"sglang/npu.py", "sglang/use.py"}  # alloc.py only stores self.need_sort
    npu = {x["line"]: x["need_sort"] for x in r["allocator_call_sites"] if x["file"] == "sglang/npu.py"}
    # a subclass of the same name resolves through the other file's class
    assert npu[4] == {"passing": "positional", "expr": "True", "resolved": base}
    assert npu[5] == {"passing": "absent", "expr": None, "resolved": None}  # inheritance cycle


def test_synthetic_origins(tmp_path):
    loc = make_tree(tmp_path, {"o.py": """\
        def make(need_sort: bool = False, x=None):
            need_sort: bool
            alloc(need_sort=need_sort)
            alloc(need_sort=self.need_sort)
            alloc(
                need_sort=False,
            )
            self.need_sort = x
            need_sort: bool = x > 1
            need_sort |= other
            s = "héllo ✓ 日本"; need_sort = "é" in s
            y = (need_sort := 3)
            total = alloc(need_sort=a or b) + other(
                1,
            )
        """})
    r = callsites.scan(str(loc))
    o = {x["line"]: x for x in r["need_sort_origins"]}
    # not 1 (default), 2 (bare annotation), 3 (pass-through), 8 (attribute store)
    assert sorted(o) == [4, 6, 9, 10, 11, 12, 13]
    assert (o[13]["expr"], o[13]["col"], o[13]["stmt_end_line"]) == ("a or b", 28, 15)  # the statement's end
    assert (o[4]["kind"], o[4]["callee"], o[4]["expr"], o[4]["literal"]) == ("keyword", "alloc", "self.need_sort", False)
    assert (o[6]["expr"], o[6]["literal"], o[6]["stmt_end_line"]) == ("False", True, 7)
    assert (o[9]["target"], o[9]["expr"]) == ("need_sort", "x > 1")
    assert o[10]["expr"] == "other"
    assert (o[12]["expr"], o[12]["literal"]) == ("3", True)
    # character (not byte) columns after non-ASCII text
    text = (loc / "sglang" / "o.py").read_text(encoding="utf-8").splitlines()[10]
    assert o[11]["value_line"] == o[11]["value_end_line"] == 11
    assert text[o[11]["value_col"]:o[11]["value_end_col"]] == '"é" in s' == o[11]["expr"]
    assert o[11]["value_col"] == o[11]["col"] == text.index('"é"')


NESTED = """\
import functools
TA = TokenToKVPoolAllocator

@register(TokenToKVPoolAllocator(1, need_sort=a in b))
class Pools:
    pool = TokenToKVPoolAllocator(2, need_sort=c or d)
    need_sort = e and f

    def method(self, alloc=TokenToKVPoolAllocator(3, need_sort=not g)):
        def inner():
            return TA(4, need_sort=h is None).start()
        return inner

x = TokenToKVPoolAllocator(size, need_sort=flag).start()
y = make_pool(need_sort=a in b).allocator
z = pools[TokenToKVPoolAllocator(5, need_sort=k[0])]
w = (lambda: TokenToKVPoolAllocator(6, need_sort=m.n))()
v = [TokenToKVPoolAllocator(i, need_sort=i > 0) for i in r]
u = f"{TokenToKVPoolAllocator(7, need_sort=p or q)!r}"
t = {"k": TokenToKVPoolAllocator(8, need_sort=-s)}["k"].free
async def g():
    need_sort = await probe()
    return (await TokenToKVPoolAllocator(9, need_sort=need_sort)).x
"""


def test_synthetic_nested_shapes_match_independent_reading(tmp_path):
    """Calls and origins inside attribute chains, subscripts, a decorator, a default argument, a
    lambda, a comprehension, an f-string, a class body, nested and async defs (review M3): the
    scanner finds exactly what the plain ast.walk reading finds, and what was read here by hand."""
    loc = make_tree(tmp_path, {"nest.py": NESTED})
    r = callsites.scan(str(loc))
    direct, aliased, origins = independent(loc)
    f = "sglang/nest.py"
    assert direct == {(f, n) for n in (4, 6, 9, 14, 16, 17, 18, 19, 20, 23)}
    assert aliased == {(f, 11)}
    assert origins == {(f, n) for n in (4, 6, 7, 9, 11, 15, 16, 17, 18, 19, 20, 22)}
    assert {k for k, x in _sites(r).items() if not x["aliased"]} == direct
    assert {k for k, x in _sites(r).items() if x["aliased"]} == aliased
    assert set(_origins(r)) == origins
    assert _sites(r)[(f, 14)]["need_sort"] == {"passing": "keyword", "expr": "flag"}
    assert _sites(r)[(f, 11)]["alias_of"] == ["TokenToKVPoolAllocator"]
    assert _origins(r)[(f, 15)]["expr"] == "a in b" and _origins(r)[(f, 15)]["callee"] == "make_pool"
    assert _origins(r)[(f, 7)]["kind"] == "assignment" and _origins(r)[(f, 7)]["expr"] == "e and f"


def test_synthetic_signatures_and_star_args(tmp_path):
    """How need_sort reaches __init__ when the call does not name it: a keyword-only or first
    positional default, a required parameter, *args / **kwargs, and the same class name in two
    files (the caller's own file decides, not the first by path)."""
    loc = make_tree(tmp_path, {
        "a.py": """\
            class KwTokenToKVPoolAllocator:
                def __init__(self, size, *, need_sort=False):
                    pass
            class FirstTokenToKVPoolAllocator:
                def __init__(self, need_sort=False, size=1):
                    pass
            class RequiredTokenToKVPoolAllocator:
                def __init__(self, size, need_sort):
                    pass
            class TwinTokenToKVPoolAllocator:
                def __init__(self, size, need_sort=True):
                    pass
            """,
        "z.py": """\
            class TwinTokenToKVPoolAllocator:
                def __init__(self, size):
                    pass
            a = KwTokenToKVPoolAllocator(1)
            b = FirstTokenToKVPoolAllocator()
            c = RequiredTokenToKVPoolAllocator(1)
            d = TwinTokenToKVPoolAllocator(1)
            e = RequiredTokenToKVPoolAllocator(*args)
            f = RequiredTokenToKVPoolAllocator(1, *rest, **kw)
            if fast:
                Alloc = KwTokenToKVPoolAllocator
            else:
                Alloc = FirstTokenToKVPoolAllocator
            g = Alloc(1)
            """})
    r = callsites.scan(str(loc))
    ns = {x["line"]: x["need_sort"] for x in r["allocator_call_sites"] if x["file"] == "sglang/z.py"}
    a = "sglang/a.py::"
    assert ns[4] == {"passing": "default", "expr": None, "resolved": a + "KwTokenToKVPoolAllocator"}
    assert ns[5] == {"passing": "default", "expr": None, "resolved": a + "FirstTokenToKVPoolAllocator"}
    assert ns[6] == {"passing": "absent", "expr": None, "resolved": a + "RequiredTokenToKVPoolAllocator"}
    assert ns[7] == {"passing": "absent", "expr": None, "resolved": "sglang/z.py::TwinTokenToKVPoolAllocator"}
    assert ns[8] == {"passing": "absent", "expr": None, "starargs": True,
                     "resolved": a + "RequiredTokenToKVPoolAllocator"}
    assert ns[9] == {"passing": "absent", "expr": None, "starargs": True, "kwargs": True,
                     "resolved": a + "RequiredTokenToKVPoolAllocator"}
    # an alias bound in both branches of an `if` at module level is seen after it
    g = [x for x in r["allocator_call_sites"] if (x["file"], x["line"]) == ("sglang/z.py", 14)]
    assert [(x["callee"], x["aliased"], x["alias_of"], x["need_sort"]) for x in g] == [
        ("Alloc", True, ["KwTokenToKVPoolAllocator", "FirstTokenToKVPoolAllocator"],
         {"passing": "default", "expr": None, "resolved": a + "KwTokenToKVPoolAllocator"})]


def test_synthetic_skips_and_errors(tmp_path):
    loc = make_tree(tmp_path, {
        "ok.py": "need_sort = True\n",
        "bad.py": "need_sort = (\n",
        "tests/t.py": "TokenToKVPoolAllocator(need_sort=True)\n",
        "srt/test/u.py": "need_sort = False\n",
        "plain.py": "x = 1\n",
    })
    r = callsites.scan(str(loc))
    assert [(o["file"], o["line"], o["literal"]) for o in r["need_sort_origins"]] == [("sglang/ok.py", 1, True)]
    assert r["allocator_call_sites"] == []
    assert [e["file"] for e in r["parse_errors"]] == ["sglang/bad.py"]
    assert "SyntaxError" in r["parse_errors"][0]["error"]
    assert r["stats"] == {"files_total": 3, "files_parsed": 1}


def test_a_fifo_or_a_symlink_among_the_sources_is_reported_not_read(tmp_path):
    """Review L11: the scan never opens a FIFO (it would hang) nor follows a link out of the tree."""
    pkg = tmp_path / "sglang"
    pkg.mkdir()
    (pkg / "a.py").write_text("x = 1\n")
    os.mkfifo(pkg / "fifo.py")
    outside = tmp_path / "outside.py"
    outside.write_text("y = 2\n")
    (pkg / "link.py").symlink_to(outside)
    t0 = time.monotonic()
    r = callsites.scan(str(tmp_path))
    assert time.monotonic() - t0 < 30
    errors = {e["file"]: e["error"] for e in r["parse_errors"]}
    assert errors == {"sglang/fifo.py": f"OSError: [Errno 22] not a regular file, not read: '{pkg}/fifo.py'",
                      "sglang/link.py": f"OSError: [Errno 22] not a regular file, not read: '{pkg}/link.py'"}


def test_a_symlinked_directory_is_reported_skipped_not_silently_left_out(tmp_path):
    """A symlinked directory in the package is never followed (it may lead out of the tree), and
    its files are not scanned: the scan says so instead of leaving them out unsaid."""
    pkg = tmp_path / "sglang"
    (pkg / "srt").mkdir(parents=True)
    (pkg / "srt" / "a.py").write_text("need_sort = True\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "b.py").write_text("need_sort = False\n")
    (pkg / "srt" / "layers").symlink_to(elsewhere, target_is_directory=True)
    r = callsites.scan(str(tmp_path))
    assert [o["file"] for o in r["need_sort_origins"]] == ["sglang/srt/a.py"]
    assert r["parse_errors"] == [{"file": "sglang/srt/layers",
                                  "error": "skipped: a symlinked directory, not followed (none of its files is scanned)"}]
