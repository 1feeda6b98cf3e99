"""Interpreters, the pure pieces (case turn3/07): an inventory's `ansible_python_interpreter` read as
Ansible reads it (shlex-split, `/usr/bin/env NAME`, options), bad values refused at load with the
file and line; the probe start's argv (options after fleetctl's own -I -S, which none can undo);
the probe wrapper parsing under the oldest grammar and the start's "no interpreter" sentence read
as the host's failure. The starts themselves, with real 2.7 / 3.6 / 3.7 interpreters:
tests/machine/test_interpreter_start.py; over sshd: tests/fleet/test_fleet_interpreters.py."""

from __future__ import annotations

import ast
import re
import textwrap

import pytest

from fleetctl import inventory, probes
from fleetctl.errors import InventoryError
from fleetctl.inventory.model import split_interpreter


@pytest.mark.parametrize("value, expected", [
    ("/usr/bin/python3", ("/usr/bin/python3", ())),
    ("/usr/libexec/platform-python", ("/usr/libexec/platform-python", ())),
    ("/usr/bin/env python3", ("python3", ())),                          # ansible/awx#4757's inventory
    ("env python3.11 -E", ("python3.11", ("-E",))),
    ("/usr/bin/env /opt/venv/bin/python", ("/opt/venv/bin/python", ())),
    ("/usr/bin/python3 -X utf8 -s", ("/usr/bin/python3", ("-X", "utf8", "-s"))),  # ansible PR #16247
    ("'/opt/my venv/bin/python' -u", ("/opt/my venv/bin/python", ("-u",))),       # quoted as a shell would
    ("python3", ("python3", ())),                                       # a name: the host's PATH
])
def test_an_interpreter_value_is_split_as_ansible_splits_it(value, expected):
    assert split_interpreter(value) == expected


@pytest.mark.parametrize("value, why", [
    ("/usr/bin/env", "names no interpreter"),
    ("/usr/bin/env -S python3", "no env options or NAME=VALUE settings"),
    ("env PYTHONUTF8=1 python3", "no env options or NAME=VALUE settings"),
    ("", "names no interpreter"),
    ("venv/bin/python", "is a relative path"),
    ("-E /usr/bin/python3", "starts with an option"),
    ("'/usr/bin/python3", "cannot be split as a shell would: No closing quotation"),
])
def test_an_interpreter_value_that_names_none_is_refused_saying_how_to_write_it(value, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        split_interpreter(value)


def test_the_inventory_reads_env_and_options_and_refuses_a_bad_value_with_file_and_line(tmp_path):
    """`ansible_python_interpreter: /usr/bin/env python3` is accepted at load (not a security
    refusal at run time), Host.interpreter gives the name the host's PATH resolves; fleetctl_python
    is read the same way; a value naming no interpreter is exit 4 naming file:line and the fix."""
    path = tmp_path / "hosts.yaml"
    path.write_text(textwrap.dedent("""\
        all:
          hosts:
            rhel8:
              ansible_python_interpreter: /usr/bin/env python3
            dgx:
              fleetctl_python: /usr/bin/python3.11 -X utf8
            auto:
              ansible_python_interpreter: auto_silent
            plain:
        """))
    inv = inventory.load(path)
    assert inv.hosts["rhel8"].python == "/usr/bin/env python3"
    assert inv.hosts["rhel8"].interpreter == ("python3", ())
    assert inv.hosts["dgx"].interpreter == ("/usr/bin/python3.11", ("-X", "utf8"))
    assert inv.hosts["auto"].interpreter is None and inv.hosts["plain"].interpreter is None
    path.write_text("all:\n  hosts:\n    rhel8:\n      ansible_python_interpreter: /usr/bin/env -S python3\n")
    with pytest.raises(InventoryError, match=rf"^{re.escape(str(path))}:4: ansible_python_interpreter: the "
                                             r"interpreter '/usr/bin/env -S python3': after env only"):
        inventory.load(path)


def test_the_start_gives_the_inventory_options_after_fleetctls_own():
    """-I -S come first, so no inventory word can undo them (a trailing `-X` would otherwise take
    `-I` as its value); the interpreter (a path or a name) and its options are separate words,
    never pasted into the script."""
    argv = probes.command("python3", options=("-X", "utf8"))
    assert argv[:2] == ["sh", "-c"] and argv[3:] == [probes.WRAPPER, "any", "python3", "-X", "utf8"]
    assert '"$p" -I -S "$@" -c "$w"' in argv[2]
    assert probes.command("/c/bin/python", guard=False, options=("-X",)) == [
        "/c/bin/python", "-I", "-S", "-X", "-c", probes.WRAPPER]
    assert probes.command(None)[3:] == [probes.WRAPPER, "any", ""]
    # an install's interpreter must run the probe itself (its packages): never another one
    assert probes.command("/opt/venv/bin/python", fallback=False)[3:] == [probes.WRAPPER, "only", "/opt/venv/bin/python"]
    assert probes.which("python3") == ["sh", "-c", 'command -v -- "$1"', "fleetctl-which", "python3"]


def test_the_wrapper_parses_under_the_oldest_grammar_and_checks_the_version_first():
    """The wrapper must run far enough on Python 3.4+ (and 2.7: tests/machine) to say it is too old:
    it parses with Python 3.4's grammar, and the version check is its first statement after
    `import sys`, before the bundle is read from stdin."""
    tree = ast.parse(probes.WRAPPER, feature_version=(3, 4))
    first = tree.body[1]
    assert isinstance(tree.body[0], ast.Import) and isinstance(first, ast.If)
    assert "sys.version_info < (3, 8)" in ast.unparse(first.test)
    assert f"sys.exit({probes.TOO_OLD_EXIT})" in ast.unparse(first)
    assert "stdin" not in ast.unparse(tree.body[0]) + ast.unparse(first)


def test_no_interpreter_is_the_starts_own_sentence():
    """The start's sentence on stderr (exit TOO_OLD_EXIT, or 127 with none at all) is NoPython with
    that sentence alone; a too-old interpreter's own line before a later one's result changes
    nothing; the marker without its exit status is a probe that printed no result."""
    old = "\nfleetctl-no-python: the probes need Python 3.8+; /usr/bin/python3 is 3.6.15\n"
    last = ("the probes need Python 3.8+; /usr/bin/python3 is 3.6.15, and no other trusted Python 3.8+ was found "
            "(a running SGLang server's, PATH's python3.8 to python3.14); set ansible_python_interpreter to a "
            "Python 3.8+ interpreter on this host")
    with pytest.raises(probes.NoPython) as err:
        probes.parse_output(b"", (old + "\n" + probes.NO_PYTHON + last + "\n").encode(), probes.TOO_OLD_EXIT)
    assert str(err.value) == last
    with pytest.raises(probes.NoPython, match="^the inventory's interpreter python3.12 is not on this host's PATH$"):
        probes.parse_output(b"", b"\nfleetctl-no-python: the inventory's interpreter python3.12 is not on this "
                                 b"host's PATH\n", 127)
    assert probes.parse_output(b'\n--fleetctl-probe-result--\n{"ok": 1}\n', old.encode(), 0) == {"ok": 1}
    with pytest.raises(probes.ProbeError) as err:
        probes.parse_output(b"", old.encode(), 1)
    assert not isinstance(err.value, probes.NoPython) and "printed no result (exit 1)" in str(err.value)
