"""The probe start with real old interpreters (case turn3/07), as root: pyenv's 2.7.18, 3.6.15 and
3.7.16 (this machine kind's image carries them in pyenv's versions directory; no 3.6 comes from PyPI,
Debian or npm) say they are too old before they read the bundle, and the start goes on to a running
SGLang server's interpreter or a python3.N on PATH, or fails with one sentence naming each one
it tried. Each start runs in a private mount and PID namespace (its own /proc: only the processes
the test starts; an empty /var/lib/fleetctl: no recorded interpreter of this machine's) with a
PATH of one directory. The same over sshd: tests/fleet/test_fleet_interpreters.py."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import missing
from fleetctl import probes

PYENV = Path("/root/.pyenv/versions")
# what the start and trust.GUARD run, besides the interpreters
TOOLS = ("sh", "readlink", "stat", "sed", "head", "id", "grep", "rm", "cat", "mkdir")
# the facts probe re-run as an install's interpreter runs it: where `import sglang` resolves, and
# under which interpreter (locate.locate's "python": {path, version}); nothing else is read
WHO = probes.bundle("facts.host", {"locate": []})


def pyenv(version: str) -> Path:
    """pyenv's python of `version` (X.Y.Z); missing: skipped, or failed under FLEETCTL_REQUIRE_LAB."""
    py = PYENV / version / "bin" / f"python{version.rsplit('.', 1)[0]}"
    if not os.access(py, os.X_OK):
        missing(f"pyenv's Python {version} is not at {py}", "FLEETCTL_REQUIRE_LAB")
    return py


@pytest.fixture
def path_dir():
    """A root-owned 0755 bin/ directory (the start's whole PATH; its prefix is root's 0755 too, as
    the trust rule asks) holding the tools, and links named python3 -> 3.6.15, python -> 2.7.18
    (Ubuntu 18.04's pair); removed after."""
    top = Path(tempfile.mkdtemp(prefix="fc-py36-", dir="/tmp"))
    top.chmod(0o755)
    d = top / "bin"
    d.mkdir(mode=0o755)
    for t in TOOLS:
        (d / t).symlink_to(shutil.which(t))
    (d / "python3").symlink_to(pyenv("3.6.15"))
    (d / "python").symlink_to(pyenv("2.7.18"))
    yield d
    shutil.rmtree(top)


def start(path_dir: Path, argv: list[str], server: Path | None = None, record: str | None = None):
    """Run probe start `argv` on WHO in a private mount and PID namespace with PATH=`path_dir`, an
    empty /var/lib/fleetctl (holding scan-cache/interpreter = `record` when given) and, when
    `server` is given, a process of it whose command line is an SGLang server's. Returns
    (exit status, stderr, the parsed result or the ProbeError, the record file's text after)."""
    setup = "mount -t tmpfs fc-state /var/lib/fleetctl"
    if record:
        setup += (" && mkdir -m 700 /var/lib/fleetctl/scan-cache && printf '%s\\n' "
                  f"{shlex.quote(record)} > /var/lib/fleetctl/scan-cache/interpreter")
    if server:
        setup += (f" && {{ {shlex.quote(str(server))} -c 'import time; time.sleep(60)' -m sglang.launch_server "
                  "--port 31999 </dev/null >/dev/null 2>&1 & }")
    script = (f'{setup} && env -i PATH="$0" "$@" </dev/stdin; rc=$?; '
              'cat /var/lib/fleetctl/scan-cache/interpreter 2>/dev/null >&2; exit $rc')
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc",
                        "sh", "-c", script, str(path_dir), *argv], input=WHO, capture_output=True, timeout=60)
    try:
        out = probes.parse_output(r.stdout, r.stderr, r.returncode)
    except probes.ProbeError as e:
        out = e
    return r.returncode, r.stderr.decode(), out


def test_the_wrapper_says_it_is_too_old_before_it_reads_the_bundle():
    """Under 2.7, 3.6 and 3.7 (run directly, as in a container or by the facts probe's ask: no
    shell around it) the wrapper exits TOO_OLD_EXIT with one line naming the interpreter and its
    version, and prints no result: nothing of the bundle was read or run."""
    for version in ("2.7.18", "3.6.15", "3.7.16"):
        py = pyenv(version)
        r = subprocess.run([str(py), "-S", "-c", probes.WRAPPER], input=WHO, capture_output=True, timeout=30)
        assert (r.returncode, r.stdout) == (probes.TOO_OLD_EXIT, b""), (version, r.stderr)
        with pytest.raises(probes.NoPython) as err:
            probes.parse_output(r.stdout, r.stderr, r.returncode)
        assert str(err.value) == f"the probes need Python 3.8+; {py} is {version}"


def test_a_host_with_only_old_interpreters_gets_one_sentence(path_dir):
    """python3 3.6 and python 2.7 on PATH, nothing else: no traceback, the start's sentence naming
    both with their versions and what to set; exit TOO_OLD_EXIT."""
    rc, err, out = start(path_dir, probes.command(None))
    assert rc == probes.TOO_OLD_EXIT and isinstance(out, probes.NoPython), err
    assert str(out) == (f"the probes need Python 3.8+; {path_dir}/python3 is 3.6.15, {path_dir}/python is 2.7.18, "
                        "and no other trusted Python 3.8+ was found (a running SGLang server's, PATH's python3.8 "
                        "to python3.14); set ansible_python_interpreter to a Python 3.8+ interpreter on this host")
    assert "Traceback" not in err


def test_a_running_servers_interpreter_is_picked_over_an_old_python3(path_dir):
    """The same PATH, an SGLang server running under 3.13 (its /proc/PID/exe): the probe runs
    under it, and with no named interpreter that is what the facts probe would record."""
    py313 = pyenv("3.13.0")
    rc, err, out = start(path_dir, probes.command(None), server=py313)
    assert rc == 0 and not isinstance(out, Exception), err
    assert out["python"] == {"path": str(py313), "version": "3.13.0"}


def test_a_named_old_interpreter_gives_way_to_a_newer_one_on_path(path_dir):
    """The inventory names 3.6 (as RHEL 8's /usr/libexec/platform-python is), by path with an
    option, or by name (`/usr/bin/env python3`): PATH's python3.12 runs the probe (no option
    given to it); a name not on PATH fails the start saying so; an install's interpreter named by
    the engine (fallback=False) is never replaced: the start fails naming it."""
    py312 = pyenv("3.12.1")
    (path_dir / "python3.12").symlink_to(py312)
    for named, options in ((str(path_dir / "python3"), ("-X", "utf8")), ("python3", ())):
        rc, err, out = start(path_dir, probes.command(named, options=options))
        assert rc == 0 and not isinstance(out, Exception), (named, err)
        assert out["python"] == {"path": str(path_dir / "python3.12"), "version": "3.12.1"}
    rc, err, out = start(path_dir, probes.command("python3.99"))
    assert rc == 127 and str(out) == "the inventory's interpreter python3.99 is not on this host's PATH", err
    # an install's interpreter (the engine's `python=`: the probe uses its packages) is never replaced
    rc, err, out = start(path_dir, probes.command(str(path_dir / "python3"), fallback=False))
    assert rc == probes.TOO_OLD_EXIT and str(out) == f"the probes need Python 3.8+; {path_dir}/python3 is 3.6.15", err


def test_a_recorded_interpreter_that_became_too_old_is_removed(path_dir):
    """The record names 3.7 (the path now holds an older Python than the one recorded): it is
    passed over and removed, and PATH's python3.12 runs the probe."""
    (path_dir / "python3.12").symlink_to(pyenv("3.12.1"))
    rc, err, out = start(path_dir, probes.command(None), record=str(pyenv("3.7.16")))
    assert rc == 0 and out["python"]["version"] == "3.12.1", err
    assert not err.rstrip().endswith(str(pyenv("3.7.16")))  # the record file is gone (start() prints it)
