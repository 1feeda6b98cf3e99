"""The scan cache (probes/facts/scancache.py) and the cached scan (probes/facts/callsites.py) on real SGLang
releases and on synthetic trees, run here as the probe runs on a host (issue 18)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import zipfile
import zlib
from pathlib import Path

import pytest

from fleetctl.probes import runas
from fleetctl.probes.facts import callsites, scancache
from fleetctl.wheels import ensure_wheel

RELEASES = ["0.4.6.post5", "0.5.2", "0.5.10", "0.5.23"]
RUN_FACTS = ("cache", "phases_s")  # how this run went, not what the tree says


@pytest.fixture(autouse=True)
def settled_now(monkeypatch):
    """Files written by the test count as settled at once (the probe waits RACY_S seconds)."""
    monkeypatch.setattr(callsites, "RACY_S", 0)


def answer(r: dict) -> dict:
    return {k: v for k, v in r.items() if k not in RUN_FACTS}


@pytest.mark.parametrize("version", RELEASES)
def test_cached_and_uncached_answers_are_identical(tmp_path, version):
    with zipfile.ZipFile(ensure_wheel(version)) as z:
        z.extractall(tmp_path, [n for n in z.namelist() if n.startswith("sglang/") and n.endswith(".py")])
    plain = callsites.scan(str(tmp_path), workers=1)
    cache: dict = {}
    cold = callsites.scan(str(tmp_path), cache=cache)
    cache = json.loads(json.dumps(cache))  # what the cache file holds
    warm = callsites.scan(str(tmp_path), cache=cache)
    assert plain["allocator_call_sites"] and answer(cold) == answer(plain) == answer(warm)
    total = plain["stats"]["files_total"]
    assert cold["cache"] == {"hits": 0, "misses": total, "changed": True}
    assert warm["cache"] == {"hits": total, "misses": 0, "changed": False}  # not written again
    assert set(warm["phases_s"]) == {"walk", "prefilter", "parse", "analysis"}


BASE = """\
class BaseTokenToKVPoolAllocator:
    def __init__(self, size, need_sort=False):
        pass
"""
SUB = """\
from .base import BaseTokenToKVPoolAllocator
class PagedTokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    pass
a = PagedTokenToKVPoolAllocator(1, True)
"""


def make_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / "sglang" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return root


def test_a_base_class_change_alone_changes_its_subclass_call_sites(tmp_path):
    """base.py holds no needle (never a candidate): only the cross-file resolution, redone every
    run, sees that its __init__ lost need_sort."""
    loc = make_tree(tmp_path, {"base.py": BASE.replace("TokenToKVPoolAllocator", "Alloc"),
                               "sub.py": SUB.replace("BaseTokenToKVPoolAllocator", "BaseAlloc")})
    cache: dict = {}
    first = callsites.scan(str(loc), cache=cache)
    assert first["allocator_call_sites"][0]["need_sort"] == {
        "passing": "positional", "expr": "True", "resolved": "sglang/base.py::BaseAlloc"}
    (loc / "sglang/base.py").write_text("class BaseAlloc:\n    def __init__(self, size, other=False):\n        pass\n")
    second = callsites.scan(str(loc), cache=cache)
    assert second["cache"] == {"hits": 1, "misses": 1, "changed": True}  # sub.py came from the cache
    assert second["allocator_call_sites"][0]["need_sort"] == {
        "passing": "absent", "expr": None, "resolved": "sglang/base.py::BaseAlloc"}
    assert answer(second) == answer(callsites.scan(str(loc)))


def test_a_same_size_rewrite_with_its_mtime_put_back_is_rescanned(tmp_path):
    loc = make_tree(tmp_path, {"base.py": BASE, "sub.py": SUB})
    cache: dict = {}
    callsites.scan(str(loc), cache=cache)
    assert callsites.scan(str(loc), cache=cache)["cache"]["misses"] == 0
    path = loc / "sglang/sub.py"
    before = path.stat()
    new = path.with_name("sub.py.new")
    new.write_text(SUB.replace("(1, True)", "(1, 0==0)"))
    assert new.stat().st_size == before.st_size
    os.replace(new, path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    r = callsites.scan(str(loc), cache=cache)
    assert r["cache"] == {"hits": 1, "misses": 1, "changed": True}
    assert r["allocator_call_sites"][0]["need_sort"]["expr"] == "0==0"


def test_a_file_changed_within_racy_s_is_not_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(callsites, "RACY_S", 3600)
    loc = make_tree(tmp_path, {"sub.py": SUB})
    cache: dict = {}
    callsites.scan(str(loc), cache=cache)
    assert cache == {}


# ---- the store -------------------------------------------------------------------------------

def test_store_round_trip_discards_what_it_cannot_trust(tmp_path):
    d = tmp_path / "c"
    s = scancache.Store("k1", str(d))
    assert s.error is None and oct(d.stat().st_mode & 0o777) == "0o700"
    s.save("host:/x/sglang", str(tmp_path), {"sglang/a.py": {"id": [1, 2, 3, 4]}})
    assert s.load("host:/x/sglang") == ({"sglang/a.py": {"id": [1, 2, 3, 4]}}, None)
    assert scancache.Store("k2", str(d)).load("host:/x/sglang")[0] == {}  # other probe sources
    path = Path(s.file_path("host:/x/sglang"))
    path.write_bytes(path.read_bytes()[:-5])  # cut short
    entries, why = s.load("host:/x/sglang")
    assert entries == {} and "not JSON" in why
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere.json")
    entries, why = s.load("host:/x/sglang")
    assert entries == {} and "discarded" in why
    s.save("host:/x/sglang", str(tmp_path), {})  # rebuilt: the link is replaced, not followed
    assert not path.is_symlink() and not (tmp_path / "elsewhere.json").exists()


def test_the_interpreter_record_is_written_once_and_only_for_a_trusted_interpreter(tmp_path):
    d = tmp_path / "c"
    s = scancache.Store("k1", str(d))
    rec = d / scancache.INTERPRETER
    s.keep_interpreter(sys.executable, lambda p: None)
    assert rec.read_text() == sys.executable + "\n"
    before = rec.stat().st_ino
    s.keep_interpreter(sys.executable, lambda p: pytest.fail("asked although the record is the same"))
    assert rec.stat().st_ino == before  # the same record is not rewritten
    s.keep_interpreter("/opt/other/bin/python3", lambda p: "owned by uid 1000")
    assert not rec.exists()  # an interpreter root must not run is never recorded
    s.keep_interpreter("python3", lambda p: None)
    assert not rec.exists()  # not an absolute path


def test_an_inventory_interpreter_is_never_recorded(tmp_path):
    """The trust probe checks an inventory interpreter under the PATH search's one: were the
    inventory's recorded, that check would start under the very interpreter it checks."""
    from fleetctl.probes.facts import host as facts
    s = scancache.Store("k1", str(tmp_path / "c"))
    facts.record_interpreter(s, {"python": "/opt/venv/bin/python"})
    assert not (tmp_path / "c" / scancache.INTERPRETER).exists()
    facts.record_interpreter(s, {"python": None})
    assert (tmp_path / "c" / scancache.INTERPRETER).read_text() == sys.executable + "\n"


def test_store_refuses_a_directory_reached_through_a_symlink(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    s = scancache.Store("k", str(tmp_path / "link" / "fleetctl"))
    assert s.fd is None and "symlink" in s.error
    assert s.load("host:/x") == ({}, None)
    assert not (tmp_path / "real" / "fleetctl").exists()


def test_store_drops_vanished_installs_and_stays_bounded(tmp_path, monkeypatch):
    s = scancache.Store("k", str(tmp_path / "c"))
    (tmp_path / "gone").mkdir()
    for i in range(3):
        (tmp_path / f"pkg{i}").mkdir()
        s.save(f"host:/pkg{i}", str(tmp_path / f"pkg{i}"), {"f": "x" * 1000})
    s.save("host:/gone", str(tmp_path / "gone"), {})
    (tmp_path / "gone").rmdir()
    monkeypatch.setattr(scancache, "MAX_DIR_BYTES", 1500)
    s.prune(["host:/pkg2"])
    left = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert Path(s.file_path("host:/gone")).name not in left
    assert Path(s.file_path("host:/pkg2")).name in left and len(left) == 2  # the oldest other one went
    assert s.clear() == 2 and not list((tmp_path / "c").iterdir())


def test_an_installs_route_finding_lives_and_goes_with_its_scan(tmp_path):
    """The verify_attention anchor kept per install (verifyroute.found_anchor: what="route") is
    kept while its install is, dropped with its package directory, and emptied by `cache clear`."""
    s = scancache.Store("k", str(tmp_path / "c"))
    for name in ("kept", "gone"):
        (tmp_path / name).mkdir()
        s.save(f"host:/{name}", str(tmp_path / name), {"f": 1})
        s.save(f"host:/{name}", str(tmp_path / name), {"backend_sha256": name}, what="route")
    (tmp_path / "gone").rmdir()
    s.prune(["host:/kept"])
    assert s.load("host:/kept", what="route") == ({"backend_sha256": "kept"}, None)
    assert s.load("host:/gone", what="route") == ({}, None)
    assert len(list((tmp_path / "c").iterdir())) == 2 and s.clear() == 2


def test_pool_size_is_bounded_by_affinity():
    assert 1 <= callsites.pool_size() <= min(callsites.MAX_WORKERS, len(os.sched_getaffinity(0)))


def test_a_warm_locate_starts_no_interpreter_until_what_it_depends_on_changes(tmp_path, monkeypatch):
    """facts.located keeps an interpreter's locate answer with the identities it depends on: a warm
    run answers from the store; a checkout's version.py rewritten sends it to the interpreter again."""
    from fleetctl import probes
    from fleetctl.probes.facts import host as facts

    monkeypatch.setattr(runas, "FLEETCTL_BUNDLE", zlib.decompress(probes.bundle("facts.host", {})).decode(),
                        raising=False)
    monkeypatch.setattr(runas, "FLEETCTL_WRAPPER", probes.WRAPPER, raising=False)
    work = tmp_path / "work"
    make_tree(work, {"__init__.py": "", "version.py": '__version__ = "0.5.23"\n'})
    store = scancache.Store("k", str(tmp_path / "c"))
    me = runas.account()  # this test's own uid (the unit room runs as nobody)
    first = facts.located(sys.executable, [str(work)], store, me)
    assert first["sglang"]["version"] == "0.5.23" and first["sglang"]["package_dir"] == str(work / "sglang")
    real_ask, asked = facts.ask, []
    monkeypatch.setattr(facts, "ask", lambda *a: asked.append(a) or real_ask(*a))
    assert facts.located(sys.executable, [str(work)], store, me) == first and asked == []
    (work / "sglang/version.py").write_text('__version__ = "0.5.24"\n')
    assert facts.located(sys.executable, [str(work)], store, me)["sglang"]["version"] == "0.5.24" and len(asked) == 1


