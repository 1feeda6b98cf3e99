"""The kbuild probe's build and test actions run locally on the CPU backend (no SSH), as root, their
children as nobody (issue 48; tests/machine runs in scripts/root-view.sh, where nobody can start
this machine's Python): a real compiler, a deadline-killed build, the checked copy root keeps, the
package's reference test on the built module, the compiler cache per account, and publish. The
build is the test run's one CPU build of kernels/verify_attention (conftest's `cpu_kernel`)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from fleetctl.probes.kernel import kbuild

NOBODY = 65534


def test_build_deadline_kills_the_whole_process_group(cpu_kernel):
    _, killed, leftovers, _ = cpu_kernel
    assert killed["timed_out"] and not killed["ok"] and killed["module_path"] is None
    assert killed["rc"] == -9
    assert leftovers == []
    assert killed["log_tail"] is not None


def test_build_after_a_killed_build_succeeds_as_nobody_and_root_keeps_a_checked_copy(cpu_kernel):
    """Issue 48: the build's child ran as nobody (a root-owned install with no server), in a
    private directory; what it made was copied into the build dir root's (0755/0644, no link)."""
    _, _, _, ok = cpu_kernel
    assert ok["ok"], ok["log_tail"]
    assert not ok["timed_out"] and ok["ran_as"] == {"uid": NOBODY, "why": "the unprivileged account nobody"}
    module = Path(ok["module_path"])
    assert module.is_file() and "verify_attention_cpu" in Path(ok["log_path"]).read_text()
    for p in [module.parent, *module.parent.rglob("*")]:
        st = p.lstat()
        assert (st.st_uid, stat.S_ISLNK(st.st_mode), st.st_mode & 0o022) == (0, False, 0), p


def test_build_waits_for_the_flock_until_its_deadline(cpu_kernel, tmp_path):
    pkg = cpu_kernel[0]
    lock_path = tmp_path / "held.lock"
    with open(lock_path, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        t0 = time.monotonic()
        r = kbuild.main(dict(action="build", src_dir=str(pkg.root), build_dir=str(tmp_path / "b"),
                             lock_path=str(lock_path), deadline_s=1, **pkg.build_params("cpu")))
    assert r["timed_out"] and not r["ok"] and r["pgid"] is None
    assert 1 <= time.monotonic() - t0 < 5


@pytest.mark.slow
def test_build_failure_returns_log_tail(tmp_path):
    (tmp_path / "broken.cpp").write_text("int f() { return undefined_name; }\n")
    r = kbuild.main(dict(action="build", src_dir=str(tmp_path), build_dir=str(tmp_path / "b"), name="broken",
                         sources=["broken.cpp"], deadline_s=300))
    assert not r["ok"] and not r["timed_out"] and r["rc"] != 0
    assert "undefined_name" in r["log_tail"]


def _test_params(pkg, src_dir, module_path):
    return dict(action="test", src_dir=str(src_dir), module_path=module_path, deadline_s=300, **pkg.test_params("cpu"))


def test_reference_test_passes_on_the_built_module(cpu_kernel):
    pkg, _, _, ok = cpu_kernel
    r = kbuild.main(_test_params(pkg, pkg.root, ok["module_path"]))
    assert r["ok"] and r["rc"] == 0, r
    # 4 shapes x 3 dtypes through each entry (req_to_token, SGLang layout), and per dtype one causal chain
    # through the SGLang entry with custom_mask None
    assert r["result"]["ok"] and len(r["result"]["cases"]) == 4 * 3 * 2 + 3 and r["result"]["failures"] == []


def test_broken_reference_fails_the_test(cpu_kernel, open_tmp):
    pkg, _, _, ok = cpu_kernel
    src = open_tmp / "verify_attention"
    shutil.copytree(pkg.root, src, ignore=shutil.ignore_patterns("__pycache__"))
    ref = src / "reference.py"
    ref.write_text(ref.read_text().replace("* sm_scale\n", "* sm_scale * 1.01\n"))
    r = kbuild.main(_test_params(pkg, src, ok["module_path"]))
    assert not r["ok"] and r["rc"] == 1
    assert r["result"]["failures"] and not r["result"]["ok"]


def test_crashing_test_module_fails_the_test(cpu_kernel, open_tmp):
    pkg, _, _, ok = cpu_kernel
    src = open_tmp / "verify_attention"
    shutil.copytree(pkg.root, src, ignore=shutil.ignore_patterns("__pycache__"))
    (src / "test_kernel.py").write_text("raise SystemExit('test module broken')\n")
    r = kbuild.main(_test_params(pkg, src, ok["module_path"]))
    assert not r["ok"] and r["rc"] == 1 and r["result"] is None
    assert "test module broken" in r["stderr_tail"]
    json.dumps(r)  # the probe result crosses SSH as JSON


TINY = """#include <Python.h>
static struct PyModuleDef tiny = {PyModuleDef_HEAD_INIT, "tiny", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_tiny(void) { return PyModule_Create(&tiny); }
"""


def _ccache_stats(cache: str) -> dict[str, int]:
    """ccache's counters for CCACHE_DIR `cache` (ccache --print-stats: NAME<TAB>VALUE lines)."""
    out = subprocess.run(["ccache", "--print-stats"], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "CCACHE_DIR": cache}).stdout
    return {k: int(v) for k, v in (line.split("\t") for line in out.splitlines() if "\t" in line)}


@pytest.mark.slow
def test_the_same_sources_under_another_build_key_compile_once(tmp_path):
    """torch puts ccache before the compiler when it is installed; the build's child (nobody) has
    a ccache directory of its own kept between builds (cache_dir/<uid>) and CCACHE_BASEDIR its
    private directory, so the same sources under a second key (another private directory each
    time) are a cache hit."""
    if not shutil.which("ccache"):
        pytest.fail("ccache is not installed: run scripts/setup.sh")
    cache = tempfile.mkdtemp(prefix="fleetctl-ccache-", dir="/tmp")
    os.chmod(cache, 0o755)
    try:
        for key in ("key1", "key2"):
            src = tmp_path / "kernels" / "tiny" / key / "src"
            src.mkdir(parents=True)
            (src / "tiny.cpp").write_text(TINY)
            r = kbuild.main(dict(action="build", src_dir=str(src), build_dir=str(src.parent / "build"), name="tiny",
                                 sources=["tiny.cpp"], deadline_s=300, cache_dir=cache))
            assert r["ok"], r["log_tail"]
            assert "ccache c++" in Path(r["log_path"]).read_text()
        st = os.stat(os.path.join(cache, str(NOBODY)))
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (NOBODY, 0o700)
        stats = _ccache_stats(os.path.join(cache, str(NOBODY)))
        hits = stats["direct_cache_hit"] + stats["preprocessed_cache_hit"]
        assert (stats["cache_miss"], hits) == (1, 1), stats
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _private_build(root: Path, key: str, pkg, ok) -> Path:
    """A private build dir STATE/kernels/NAME/<key> as deploy leaves it: the package's sources in
    src/ (owned by nobody, 0600: what the copy must not keep), the CPU build in build/, PASSED."""
    bdir = root / "state" / "kernels" / "verify_attention" / key
    shutil.copytree(pkg.root, bdir / "src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(Path(ok["module_path"]).parent, bdir / "build", symlinks=True)
    for p in (bdir / "src").rglob("*"):
        if p.is_file():
            p.chmod(0o600)
            os.chown(p, 65534, 65534)
    (bdir / "build.lock").touch()
    (bdir / "PASSED").write_text(str(bdir / "build" / Path(ok["module_path"]).name) + "\n")
    return bdir


def _publish(bdir: Path, public: Path, key: str) -> dict:
    return kbuild.main(dict(action="publish", build_dir=str(bdir), public_dir=str(public / "verify_attention" / key)))


def test_publish_copies_the_build_root_owned_and_its_module_works_there(cpu_kernel, tmp_path, open_tmp):
    """kbuild's publish: a real copy of the private build at PUBLIC/NAME/<key>, root:root, dirs
    0755, files 0644 (0755 where the owner may execute), PASSED naming the published module,
    route-evidence 01777; the package's reference test passes on the published module with the
    private build gone; a second publish reuses the copy and changes nothing in it. route-evidence
    is root's 0755 (review R4-5: no other user may make an entry in it)."""
    pkg, _, _, ok = cpu_kernel
    assert ok["ok"], ok["log_tail"]
    key = "k" * 64
    bdir, public = _private_build(tmp_path, key, pkg, ok), open_tmp / "public"
    r = _publish(bdir, public, key)
    pdir = public / "verify_attention" / key
    module = pdir / "build" / Path(ok["module_path"]).name
    assert r == {"ok": True, "published": str(pdir), "module_path": str(module), "reused": False,
                 "evidence_dir": str(public / "route-evidence")}, r
    assert (pdir / "PASSED").read_text() == f"{module}\n"
    assert sorted(p.name for p in (public / "verify_attention").iterdir()) == [key]  # no temp dir left
    assert sorted(p.name for p in pdir.iterdir()) == ["PASSED", "build", "src"]  # build.lock stays private
    seen = 0
    for p in [pdir, *pdir.rglob("*")]:
        st = p.lstat()
        assert (st.st_uid, st.st_gid) == (0, 0), p
        assert not p.is_symlink(), p
        want = 0o755 if p.is_dir() or p.suffix == ".so" else 0o644
        assert stat.S_IMODE(st.st_mode) == want, (p, oct(st.st_mode))
        seen += 1
    assert seen > 20
    ev = (public / "route-evidence").lstat()
    assert (ev.st_uid, stat.S_IMODE(ev.st_mode), stat.S_ISDIR(ev.st_mode)) == (0, 0o755, True)
    for d in (public, public / "verify_attention"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o755
    shutil.rmtree(bdir)  # the published copy stands alone
    t = kbuild.main(_test_params(pkg, pdir / "src", str(module)))
    assert t["ok"], t
    before = {str(p): (p.stat().st_ino, p.stat().st_mtime_ns) for p in pdir.rglob("*")}
    again = _publish(bdir, public, key)  # no private build any more: the published one is reused as it is
    assert again["ok"] and again["reused"] is True and again["module_path"] == str(module), again
    assert {str(p): (p.stat().st_ino, p.stat().st_mtime_ns) for p in pdir.rglob("*")} == before


def _fake_build(root: Path, key: str) -> Path:
    bdir = root / "state" / key
    (bdir / "src").mkdir(parents=True)
    (bdir / "build").mkdir()
    (bdir / "src" / "a.py").write_text("A = 1\n")
    (bdir / "build" / "m.so").write_bytes(b"\x7fELF")
    (bdir / "PASSED").write_text(str(bdir / "build" / "m.so") + "\n")
    return bdir


def test_publish_makes_each_servers_evidence_dir_and_takes_back_one_someone_else_made(tmp_path):
    """route-evidence/<uid> for root and each server's effective uid; a route-evidence left 01777
    by an earlier release becomes root's 0755 (review R4-5), and what another user made in it
    meanwhile (a directory of theirs 1100 deep, a link) is removed, never followed, and made again."""
    key, public = "c" * 64, tmp_path / "public"
    bdir = _fake_build(tmp_path, key)
    ev = public / "route-evidence"
    ev.mkdir(parents=True)
    public.chmod(0o755)
    ev.chmod(0o1777)
    (ev / "0").mkdir()
    (ev / "0" / "1.json").write_text("{}")
    os.chown(ev / "0", NOBODY, NOBODY)  # a local user blocking root's server
    fd = os.open(ev / "0", os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(1100):  # past Python's recursion limit (the review's RecursionError), each by its fd
        os.mkdir("a", dir_fd=fd)
        fd, old = os.open("a", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd), fd
        os.close(old)
    os.close(fd)
    os.symlink("/etc", ev / str(NOBODY))  # and the nobody server's
    server = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sleep", "60"])
    try:
        time.sleep(0.3)
        r = kbuild.main({"action": "publish", "build_dir": str(bdir), "public_dir": str(public / "verify_attention" / key),
                         "server_pids": [server.pid, "x", -1]})
    finally:
        server.kill()
        server.wait()
    assert r["ok"], r
    for uid in (0, NOBODY):
        st = (ev / str(uid)).lstat()
        assert stat.S_ISDIR(st.st_mode) and (st.st_uid, stat.S_IMODE(st.st_mode)) == (uid, 0o755), (uid, st)
    assert list((ev / "0").iterdir()) == []  # what the other user put there went with their directory
    assert (ev.lstat().st_uid, stat.S_IMODE(ev.lstat().st_mode)) == (0, 0o755)
    assert os.path.isdir("/etc") and os.listdir("/etc")  # the link was removed, never followed


def test_publish_refuses_a_link_in_the_build_and_publishes_nothing(tmp_path):
    key, public = "a" * 64, tmp_path / "public"
    bdir = _fake_build(tmp_path, key)
    os.symlink("/etc/shadow", bdir / "build" / "planted")
    r = _publish(bdir, public, key)
    assert not r["ok"] and r["error"] == f"not published: {bdir}/build/planted is a symbolic link: not copied", r
    assert list((public / "verify_attention").iterdir()) == []  # neither the key nor a temp dir


def test_publish_refuses_foreign_or_shared_directories_and_a_tampered_copy(tmp_path):
    key, public = "b" * 64, tmp_path / "public"
    bdir = _fake_build(tmp_path, key)
    public.mkdir(mode=0o755)
    public.chmod(0o777)
    r = _publish(bdir, public, key)
    assert not r["ok"] and "is writable by group or others (mode 777): not publishing there" in r["error"], r
    public.chmod(0o755)
    os.chown(public, 65534, 65534)
    r = _publish(bdir, public, key)
    assert not r["ok"] and "is owned by uid 65534, not root" in r["error"], r
    os.chown(public, 0, 0)
    assert _publish(bdir, public, key)["reused"] is False
    (public / "verify_attention" / key / "src" / "a.py").chmod(0o666)  # a published copy someone loosened
    r = _publish(bdir, public, key)
    assert not r["ok"] and "writable by others (mode 666): not reusing it" in r["error"], r
    # a directory of the key without PASSED was never published: replaced; a killed publish's temp dir removed
    shutil.rmtree(public / "verify_attention" / key)
    (public / "verify_attention" / key).mkdir()
    (public / "verify_attention" / f".{key}.0123456789abcdef").mkdir()
    r = _publish(bdir, public, key)
    assert r["ok"] and r["reused"] is False, r
    assert sorted(p.name for p in (public / "verify_attention").iterdir()) == [key]
    assert (public / "verify_attention" / key / "PASSED").read_text() == f"{public}/verify_attention/{key}/build/m.so\n"


def test_an_untested_build_is_published_without_passed_tested_there_as_nobody_and_marked(cpu_kernel, tmp_path,
                                                                                        open_tmp):
    """Issue 48: deploy publishes the new build first without PASSED (nothing activates it), runs
    the reference test on that root-owned copy as nobody (what is tested is what is activated),
    then mark writes PASSED in the private build and in the published one."""
    pkg, _, _, ok = cpu_kernel
    key = "u" * 64
    bdir = _private_build(tmp_path, key, pkg, ok)
    os.unlink(bdir / "PASSED")
    private_module = str(bdir / "build" / Path(ok["module_path"]).name)
    public = open_tmp / "public"
    pdir = public / "verify_attention" / key
    r = kbuild.main(dict(action="publish", build_dir=str(bdir), public_dir=str(pdir), untested=private_module))
    assert r["ok"] and not r["reused"] and not (pdir / "PASSED").exists(), r
    t = kbuild.main(_test_params(pkg, pdir / "src", r["module_path"]))
    assert t["ok"] and t["ran_as"]["uid"] == NOBODY, t
    assert kbuild.main(dict(action="mark", build_dir=str(bdir), module_path=private_module, public_dir=str(pdir),
                            public_module=r["module_path"]))["ok"]
    assert (pdir / "PASSED").read_text() == r["module_path"] + "\n" and (bdir / "PASSED").is_file()
    st = (pdir / "PASSED").stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o644)
    again = kbuild.main(dict(action="publish", build_dir=str(bdir), public_dir=str(pdir)))
    assert again["ok"] and again["reused"], again  # deploy's publish after the test: the tested copy
