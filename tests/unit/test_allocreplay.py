"""The allocator replay's pure pieces (probes/traffic/allocreplay.py and replaychild.py,
report/terminal.py replay_line, cli/options.py replay_trace): the seeded trace, the figures of a
run, the trace's checks, where each release keeps its allocator classes (held against a second,
regex reading of the wheels' files), which files the replay would run, the stub import of a release
file, the server's max_total_num_tokens over real HTTP on loopback, and the report's one line. The
replay itself (torch, the lab's releases) is tests/fleet/test_fleet_allocator_replay.py."""

from __future__ import annotations

import http.server
import json
import os
import re
import sys
import threading
import zipfile

import pytest

from fleetctl.cli.options import replay_trace
from fleetctl.report.terminal import replay_line
from fleetctl.errors import UsageError
from fleetctl.probes.traffic import allocreplay, replaychild
from fleetctl.wheels import ensure_wheel

RELEASES = ["0.4.6.post5", "0.5.2", "0.5.10", "0.5.23"]
TRACE = {"requests": 400, "input": [64, 2048], "output": [100, 200], "aborts": 0.1, "seed": 3}


# ---- the trace -----------------------------------------------------------------------------

def test_the_trace_is_its_seeds_and_stays_in_its_ranges():
    a = allocreplay.make_trace(TRACE)
    assert a == allocreplay.make_trace(dict(TRACE)) and len(a) == 400
    assert a != allocreplay.make_trace(dict(TRACE, seed=4))
    assert all(64 <= p <= 2048 for p, _ in a)
    # outputs come from 100:200, but an aborted request stops after 1 to 8 tokens
    aborted = [o for _, o in a if o < 100]
    assert all(1 <= o <= 8 for o in aborted) and all(100 <= o <= 200 for _, o in a if o >= 100)
    assert 0.05 * 400 <= len(aborted) <= 0.15 * 400, len(aborted)
    assert len({p for p, _ in a}) > 300  # spread over the range, not a constant
    assert all(o >= 100 for _, o in allocreplay.make_trace(dict(TRACE, aborts=0)))
    assert all(o <= 8 for _, o in allocreplay.make_trace(dict(TRACE, aborts=1)))
    # an abort never makes a request longer than it was drawn
    assert all(o == 1 for _, o in allocreplay.make_trace(dict(TRACE, output=[1, 1], aborts=1)))


def test_the_figures_of_a_run():
    runs = [1] * 50 + list(range(2, 52))  # 100 prefills, half of them contiguous
    assert replaychild.summary(runs) == {"prefills": 100, "runs_per_alloc_mean": (50 + sum(range(2, 52))) / 100,
                                         "runs_per_alloc_p99": 50, "contiguous_share": 0.5}
    assert replaychild.summary([7]) == {"prefills": 1, "runs_per_alloc_mean": 7, "runs_per_alloc_p99": 7,
                                        "contiguous_share": 0}
    assert replaychild.summary([]) == {"prefills": 0, "runs_per_alloc_mean": None, "runs_per_alloc_p99": None,
                                       "contiguous_share": None}


@pytest.mark.parametrize("change,why", [
    ({"pool": 0}, "--pool must be at least 1, not 0"),
    ({"concurrency": 0}, "--concurrency must be at least 1, not 0"),
    ({"requests": 0}, "--requests must be at least 1, not 0"),
    ({"input": [9, 8]}, "--input 9:8: want 1 <= A <= B"),
    ({"output": [0, 8]}, "--output 0:8: want 1 <= A <= B"),
    ({"aborts": 1.5}, "--aborts 1.5: want a share from 0 to 1"),
    ({"pool": 3000}, "the longest request (--input 2048 + --output 1024, 3072 tokens in pages of 16) does not fit "
                     "the pool of 3000 (--pool): give a larger --pool or shorter lengths"),
    ({"pool": 3072}, None),
    ({"pool": 3072, "page_size": 1000}, "the longest request (--input 2048 + --output 1024, 4000 tokens in pages of "
                                        "1000) does not fit the pool of 3072 (--pool)"),
])
def test_the_trace_checks_name_the_flag(change, why):
    got = allocreplay.check_trace(dict(allocreplay.DEFAULTS, **change))
    assert (got is None) if why is None else got.startswith(why), got


def test_the_command_line_gives_the_trace_or_says_which_option_is_wrong():
    assert replay_trace(False, None, None, None, None, None, None, None) is None
    assert replay_trace(True, None, 8, "1:2", " 3 : 4", 0.5, 9, 10) == {
        "pool": None, "concurrency": 8, "input": [1, 2], "output": [3, 4], "aborts": 0.5, "seed": 9, "requests": 10}
    with pytest.raises(UsageError, match=r"^--pool, --seed: only with --allocator-replay$"):
        replay_trace(False, 5, None, None, None, None, 1, None)
    with pytest.raises(UsageError, match=r"^--input 64-128: want A:B, two whole numbers of tokens \(e.g. 64:2048\)$"):
        replay_trace(True, None, None, "64-128", None, None, None, None)
    with pytest.raises(UsageError, match=r"^--output 5:2: want 1 <= A <= B$"):
        replay_trace(True, None, None, None, "5:2", None, None, None)
    # a pool too small for the longest request is known before any host is asked; none given is the server's
    with pytest.raises(UsageError, match=r"^the longest request \(--input 2048 \+ --output 1024"):
        replay_trace(True, 100, None, None, None, None, None, None)
    assert replay_trace(True, None, None, "1:5000000", None, None, None, None)["input"] == [1, 5000000]


# ---- where the classes are ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict[str, str]:
    """{release: a site-packages-like dir holding its sglang/srt/mem_cache/ .py files}."""
    out = {}
    for v in RELEASES:
        d = tmp_path_factory.mktemp("mc-" + v)
        with zipfile.ZipFile(ensure_wheel(v)) as z:
            z.extractall(d, [n for n in z.namelist() if n.startswith("sglang/srt/mem_cache/") and n.endswith(".py")])
        out[v] = str(d)
    return out


def regex_reading(location: str) -> dict[str, tuple[str, int, bool]]:
    """A second reading: {class: (file, line, its __init__ names need_sort)} of the first
    `class TokenToKVPoolAllocator` / `class PagedTokenToKVPoolAllocator` line under
    sglang/srt/mem_cache (the allocator package, then allocator.py, memory_pool.py,
    paged_allocator.py), the __init__ read as the text from its `def __init__(` to `):`."""
    order = [os.path.join("allocator", n) for n in sorted(os.listdir(os.path.join(location, "sglang/srt/mem_cache/allocator")))
             ] if os.path.isdir(os.path.join(location, "sglang/srt/mem_cache/allocator")) else []
    order += ["allocator.py", "memory_pool.py", "paged_allocator.py"]
    out = {}
    for rel in order:
        path = os.path.join(location, "sglang/srt/mem_cache", rel)
        if not os.path.isfile(path):
            continue
        text = open(path).read()
        for name in ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator"):
            m = re.search(rf"^class {name}\b.*$", text, re.M)
            if m and name not in out:
                init = re.search(r"def __init__\((.*?)\):", text[m.end():], re.S)
                out[name] = ("sglang/srt/mem_cache/" + rel, text.count("\n", 0, m.start()) + 1,
                             "need_sort" in init.group(1))
    return out


@pytest.mark.parametrize("version", RELEASES)
def test_each_release_s_classes_are_found_where_a_second_reading_finds_them(releases, version):
    got = allocreplay.find_classes(os.path.join(releases[version], "sglang"), releases[version])
    assert {c["class"]: (c["file"], c["line"], c["need_sort"]) for c in got} == regex_reading(releases[version])
    assert [c["kind"] for c in got] == ["token", "paged"]
    assert all(c["need_sort"] is (version != "0.4.6.post5") for c in got)
    for c in got:
        assert c["modules"][0] == [c["module"], c["file"]]
        assert c["module"] == c["file"][:-3].replace("/", ".")


def test_in_the_allocator_package_the_modules_a_class_file_imports_are_loaded_too(releases):
    token, paged = allocreplay.find_classes(os.path.join(releases["0.5.23"], "sglang"), releases["0.5.23"])
    base = ["sglang.srt.mem_cache.allocator.base", "sglang/srt/mem_cache/allocator/base.py"]
    assert token["modules"] == [["sglang.srt.mem_cache.allocator.token", "sglang/srt/mem_cache/allocator/token.py"], base]
    assert paged["modules"] == [["sglang.srt.mem_cache.allocator.paged", "sglang/srt/mem_cache/allocator/paged.py"], base]
    # a single-file release loads that file alone: memory_pool.py, which it imports, is a stub
    (t, _) = allocreplay.find_classes(os.path.join(releases["0.5.2"], "sglang"), releases["0.5.2"])
    assert t["modules"] == [["sglang.srt.mem_cache.allocator", "sglang/srt/mem_cache/allocator.py"]]


def test_a_relative_import_in_the_package_resolves_and_a_missing_module_is_passed_over(tmp_path):
    pkg = tmp_path / "sglang/srt/mem_cache/allocator"
    pkg.mkdir(parents=True)
    (pkg / "common.py").write_text("X = 1\n")
    (pkg / "base.py").write_text("from . import common\nclass Base:\n    def __init__(self, need_sort): pass\n")
    (pkg / "token.py").write_text("from .base import Base\nfrom .gone import Y\nimport os\n"
                                  "class TokenToKVPoolAllocator(Base):\n    pass\n")
    (token,) = allocreplay.find_classes(str(tmp_path / "sglang"), str(tmp_path))
    assert token["need_sort"] is None  # its __init__ is base.py's: not known without importing it
    assert [m for m, _ in token["modules"]] == ["sglang.srt.mem_cache.allocator.token",
                                                "sglang.srt.mem_cache.allocator.base",
                                                "sglang.srt.mem_cache.allocator.common"]


def test_only_files_of_root_or_this_user_that_nobody_else_can_write_are_run(tmp_path):
    good = tmp_path / "allocator.py"
    good.write_text("x = 1\n")
    good.chmod(0o644)
    assert allocreplay.read_trusted(str(good)) == ("x = 1\n", None)
    good.chmod(0o664)
    assert allocreplay.read_trusted(str(good)) == (None, f"{good} is writable by group or others")
    good.chmod(0o644)
    link = tmp_path / "link.py"
    link.symlink_to(good)
    text, why = allocreplay.read_trusted(str(link))
    assert text is None and why.startswith(f"cannot open {link}: ")
    fifo = tmp_path / "fifo.py"
    os.mkfifo(fifo)
    assert allocreplay.read_trusted(str(fifo)) == (None, f"{fifo} is not a regular file")
    if os.geteuid() == 0:
        os.chown(good, 65534, 65534)
        assert allocreplay.read_trusted(str(good)) == (None, f"{good} belongs to uid 65534")


# ---- the stub import ----------------------------------------------------------------------------

RELEASE_FILE = '''from __future__ import annotations
import json
import triton
import triton.language as tl
from sglang.srt.utils import get_bool_env_var, next_power_of_2
from sglang.srt.mem_cache.memory_pool import SWAKVPool


@triton.jit
def kernel(x, n: tl.constexpr):
    pass


@triton.autotune(configs=[])
def tuned():
    pass


class Alloc(SWAKVPool):
    def __init__(self):
        self.debug = get_bool_env_var("SGLANG_DEBUG_MEMORY_POOL")
        self.dumps = json.dumps
'''


@pytest.fixture
def finder():
    """A ReleaseFinder first on sys.meta_path for one test; the modules it made are forgotten after."""
    before = set(sys.modules)
    made = []

    def install(sources):
        f = replaychild.ReleaseFinder(sources, [])
        sys.meta_path.insert(0, f)
        made.append(f)
        return f

    yield install
    for f in made:
        sys.meta_path.remove(f)
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("sglang", "triton"):
            del sys.modules[name]


def test_a_release_file_loads_with_triton_and_the_other_sglang_modules_stubbed(finder):
    import importlib
    f = finder({"sglang.srt.mem_cache.allocator": ["sglang/srt/mem_cache/allocator.py", RELEASE_FILE]})
    m = importlib.import_module("sglang.srt.mem_cache.allocator")
    assert m.__file__ == "sglang/srt/mem_cache/allocator.py"
    a = m.Alloc()
    assert not a.debug and a.dumps is json.dumps  # a stub is false; the standard library is the real one
    assert m.Alloc.__mro__ == (m.Alloc, object)  # a stubbed base class is object
    assert isinstance(m.kernel, replaychild.Stub) and isinstance(m.tuned, replaychild.Stub)
    assert list(m.next_power_of_2(5)) == []
    assert sorted(set(f.stubbed)) == ["sglang", "sglang.srt", "sglang.srt.mem_cache", "sglang.srt.mem_cache.memory_pool",
                                      "sglang.srt.utils", "triton", "triton.language"]


def test_a_file_that_needs_a_module_neither_installed_nor_stubbed_says_which_file_and_line(finder):
    import importlib
    src = "import torch_not_here_either\n"
    finder({"sglang.srt.mem_cache.allocator": ["sglang/srt/mem_cache/allocator.py", "import os\n" + src]})
    with pytest.raises(ImportError) as e:
        importlib.import_module("sglang.srt.mem_cache.allocator")
    files = {"sglang/srt/mem_cache/allocator.py": "sglang.srt.mem_cache.allocator"}
    assert replaychild._where(e.value, files) == "sglang/srt/mem_cache/allocator.py line 2"
    assert replaychild._said(e.value) == ("ModuleNotFoundError: No module named 'torch_not_here_either' (neither "
                                          "installed nor stubbed: the replay stubs only sglang and triton modules)")


# ---- the server's pool, over HTTP on loopback ----------------------------------------------------

@pytest.fixture
def server_info():
    """An HTTP server on 127.0.0.1 answering GET /server_info and /get_server_info with `answers`
    ({path: (status, body)}), recording each request's Authorization header in `seen`."""
    answers, seen = {}, []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            status, body = answers.get(self.path, (404, {}))
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield httpd.server_address[1], answers, seen
    httpd.shutdown()
    httpd.server_close()


def test_the_pool_is_the_max_total_num_tokens_the_server_states(server_info):
    port, answers, seen = server_info
    answers["/server_info"] = (200, {"max_total_num_tokens": 123456, "model_path": "m"})
    assert allocreplay._max_total_num_tokens("127.0.0.1", port, "k3y") == (123456, None)
    assert seen == [("/server_info", "Bearer k3y")]
    answers["/server_info"] = (401, {"error": "unauthorized"})
    answers["/get_server_info"] = (200, {"max_total_num_tokens": 777})  # releases before 0.5
    assert allocreplay._max_total_num_tokens("127.0.0.1", port, None) == (777, None)
    answers["/get_server_info"] = (404, {})
    assert allocreplay._max_total_num_tokens("127.0.0.1", port, None) == (None, "/get_server_info answered HTTP 404")
    answers["/server_info"] = (200, {"stand_in": True, "max_total_num_tokens": True})
    assert allocreplay._max_total_num_tokens("127.0.0.1", port, None) == (
        None, "/server_info states no max_total_num_tokens (a stand-in)")


# ---- the report's line ------------------------------------------------------------------------

def run(kind, need_sort, mean, share, sorts, prefills=800, page=1, max_s=0.0016):
    return {"kind": kind, "need_sort": need_sort, "page_size": page, "runs_per_alloc_mean": mean,
            "contiguous_share": share, "sorts": sorts, "prefills": prefills, "sort_max_s": max_s}


TRACE_INFO = {"pool": 65536, "pool_source": "--pool", "concurrency": 16, "requests": 800, "seed": 0}


def test_the_report_says_in_one_line_what_defrag_tier0_would_change():
    runs = [run("token", False, 847.4, 0.081, 0), run("token", True, 89.4, 0.395, 27),
            run("paged", False, 54.9, 0.026, 0, page=16), run("paged", True, 7.2, 0.396, 27, page=16, max_s=0.0085)]
    line = replay_line({"status": "replayed", "trace": TRACE_INFO}, runs)
    assert line == ("defrag-tier0 here (with headroom): token 847.4 -> 89.4 runs per prefill (9.5x fewer; contiguous "
                    "8% -> 40%; 27 sorts in 800 prefills, 1.6 ms max); paged/16 54.9 -> 7.2 runs per prefill (7.6x "
                    "fewer; contiguous 3% -> 40%; 27 sorts in 800 prefills, 8.5 ms max) [pool 65536 (--pool), "
                    "16 concurrent, 800 requests, seed 0]")
    assert "\n" not in line
    pressed = [run("token", False, 824.3, 0.051, 0, 1500), run("token", True, 681.9, 0.058, 1440, 1500, max_s=0.0042)]
    assert replay_line({"status": "replayed", "trace": TRACE_INFO}, pressed).startswith(
        "defrag-tier0 here (UNDER PRESSURE, a sort on most admissions): token 824.3 -> 681.9 runs per prefill "
        "(1.2x fewer; contiguous 5% -> 6%; 1440 sorts in 1500 prefills, 4.2 ms max) [pool 65536")
    assert replay_line({"status": "no_need_sort", "reason": "no need_sort: TokenToKVPoolAllocator (f:1) takes no "
                        "need_sort"}, []) == ("defrag-tier0 would change nothing here: no need_sort: "
                                              "TokenToKVPoolAllocator (f:1) takes no need_sort")
    assert replay_line({"status": "failed", "reason": "f line 2 needs more"}, []) == "not replayed: f line 2 needs more"
