"""The interpreter trust rule (probes/trust.py, review N7/N10) on real trees of files owned by
other users, as root: the sh check every probe start runs (trust.GUARD, through
probes.command's start) and the Python one (trust.untrusted without the site files) give the
same verdict, word for word; a refused interpreter never runs, a cleared one runs directly. The
same through sshd: tests/fleet/test_fleet_hostile_containers.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from fleetctl import probes
from fleetctl.probes import trust

NOBODY = 65534
# a stand-in interpreter: says it ran, with what it was given
FAKE = "#!/bin/sh\necho \"RAN $*\" | head -c 40\n"


@pytest.fixture
def tree():
    """A directory under /tmp (sticky, root's: passes) holding `root/venv/bin/python` (root's
    0755 all the way, a fake interpreter); removed after."""
    top = Path(tempfile.mkdtemp(prefix="fc-trust-", dir="/tmp"))
    py = top / "root" / "venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(FAKE)
    for p in (top, top / "root", top / "root" / "venv", py.parent):
        p.chmod(0o755)
    py.chmod(0o755)
    yield top, py
    shutil.rmtree(top, ignore_errors=True)


def guard(python: Path) -> tuple[int, str]:
    r = subprocess.run(["sh", "-c", trust.GUARD + '\nfleetctl_trust "$1"', "sh", str(python)],
                       capture_output=True, text=True, timeout=30)
    return r.returncode, r.stdout.strip()


def start(python: Path) -> subprocess.CompletedProcess:
    """What a probe's start does with `python` (probes.command, guarded)."""
    return subprocess.run(probes.command(str(python)), input="", capture_output=True, text=True, timeout=30)


def both(python: Path) -> str | None:
    """The verdict, asserted equal from the sh check and the Python one."""
    code, said = guard(python)
    why = trust.untrusted(str(python))
    assert (code != 0, said or None) == (why is not None, why), (said, why)
    return why


def test_a_root_tree_is_cleared_and_runs(tree):
    top, py = tree
    assert both(py) is None
    r = start(py)
    assert r.returncode == 0 and r.stdout.startswith("RAN -I -S -c"), (r.stdout, r.stderr)


def test_a_directory_above_the_venv_owned_by_another_user_is_refused_and_never_runs(tree):
    """Review N7's tree: a root venv under a directory nobody owns (who can rename the venv
    away and put their own in its place)."""
    top, py = tree
    os.chown(top / "root", NOBODY, NOBODY)
    assert both(py) == f"{top}/root belongs to uid {NOBODY}"
    r = start(py)
    assert (r.returncode, r.stdout) == (126, "")
    assert r.stderr.strip().endswith(f"{probes.REFUSED}{top}/root belongs to uid {NOBODY}")


@pytest.mark.parametrize("mode, refused", [(0o775, True), (0o757, True), (0o1777, False), (0o755, False)])
def test_a_writable_directory_above_is_refused_unless_root_owned_and_sticky(tree, mode, refused):
    top, py = tree
    (top / "root").chmod(mode)
    want = f"{top}/root is writable by group or others" if refused else None
    assert both(py) == want


def test_a_sticky_directory_of_another_user_is_refused(tree):
    top, py = tree
    os.chown(top / "root", NOBODY, NOBODY)
    (top / "root").chmod(0o1777)
    assert both(py) == f"{top}/root belongs to uid {NOBODY}"


def test_a_pyvenv_cfg_of_another_user_is_refused(tree):
    """pyvenv.cfg's `home` picks the standard library even under -S."""
    top, py = tree
    cfg = top / "root" / "venv" / "pyvenv.cfg"
    cfg.write_text("home = /usr/bin\n")
    os.chown(cfg, NOBODY, NOBODY)
    assert both(py) == f"{cfg} belongs to uid {NOBODY}"
    os.chown(cfg, 0, 0)
    assert both(py) is None


def test_a_link_to_an_interpreter_under_another_users_directory_is_refused(tree):
    """The interpreter named is a link: the directories above its target count too."""
    top, py = tree
    other = top / "theirs"
    other.mkdir()
    real = other / "python3.11"
    shutil.copy(py, real)
    os.chown(other, NOBODY, NOBODY)
    py.unlink()
    py.symlink_to(real)
    assert both(py) == f"{other} belongs to uid {NOBODY}"


def test_a_swap_between_two_starts_is_seen_by_the_second(tree):
    """Nothing is cached: the same path cleared on one start and swapped for another user's
    file before the next is refused on the next (review N7: the verdict was kept per connection)."""
    top, py = tree
    assert start(py).returncode == 0
    os.chown(py, NOBODY, NOBODY)
    r = start(py)
    assert r.returncode == 126 and "RAN" not in r.stdout
    assert r.stderr.strip().endswith(f"{py} belongs to uid {NOBODY}")


def test_a_standard_library_directory_of_another_user_is_refused(tree):
    """Review round 3's red team: what `python -S` loads at start (lib/python3.*, encodings)
    counts, not only the binary: a prefix whose lib/ another user owns is refused."""
    top, py = tree
    lib = top / "root" / "venv" / "lib"
    (lib / "python3.11" / "encodings").mkdir(parents=True)
    os.chown(lib, NOBODY, NOBODY)
    assert both(py) == f"{lib} belongs to uid {NOBODY}"
    os.chown(lib, 0, 0)
    os.chown(lib / "python3.11" / "encodings", NOBODY, NOBODY)
    assert both(py) == f"{lib}/python3.11/encodings belongs to uid {NOBODY}"


def test_a_pyvenv_home_of_another_user_is_refused(tree):
    """A root-owned pyvenv.cfg whose `home` names an install another user owns: that install's
    standard library would run, so it is refused."""
    top, py = tree
    theirs = top / "theirs" / "bin"
    theirs.mkdir(parents=True)
    os.chown(theirs, NOBODY, NOBODY)
    (top / "root" / "venv" / "pyvenv.cfg").write_text(f"home = {theirs}\ninclude-system-site-packages = false\n")
    assert both(py) == f"{theirs} belongs to uid {NOBODY}"


def test_an_interpreter_directly_in_a_sticky_directory_is_refused(tree):
    """/tmp-like (root's, sticky, 1777) is fine above a prefix, not as the interpreter's own
    directory or prefix, where getpath looks for names (pyvenv.cfg, lib/) anyone could create."""
    top, py = tree
    (top / "root" / "venv").chmod(0o1777)
    assert both(py) == f"{top}/root/venv is writable by group or others"


def test_a_link_through_another_users_directory_is_refused(tree):
    """A link chain whose middle hop lies in a directory another user owns (who can flip it
    between the check and the exec): every directory consulted while resolving counts."""
    top, py = tree
    alice = top / "alice"
    alice.mkdir()
    (alice / "cur").symlink_to(py)
    os.chown(alice, NOBODY, NOBODY)
    named = top / "root" / "python"
    named.symlink_to(alice / "cur")
    assert both(named) == f"{alice} belongs to uid {NOBODY}"


def test_the_working_directory_is_never_on_the_probes_path(tree):
    """A probe started from a directory another user owns never imports a module planted there
    (every start is `python -I -S`)."""
    top, py = tree
    cwd = top / "cwd"
    cwd.mkdir()
    mark = cwd / "imported"
    (cwd / "json.py").write_text(f"open({str(mark)!r}, 'w').close()\n")
    os.chown(cwd, NOBODY, NOBODY)
    for python in ("/usr/bin/python3", None):
        r = subprocess.run(probes.command(python), input=b"", capture_output=True, timeout=30, cwd=cwd)
        assert probes.result.MARKER.encode() in r.stdout, r
        assert not mark.exists(), python
