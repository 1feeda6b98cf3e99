"""What a newcomer types in the first hour (issue 50; shared/reviews/newcomer-turn4.md, items 2, 5, 9
and 10): --version and shell completion; -v showing what was dialled and each connection phase's
time; connection errors that name the fix (a refused port, a listener that sends no banner, a
ProxyCommand that exits) against real sockets and a real ProxyCommand, no sshd needed (the kinds
that need one are in tests/fleet/test_fleet_connection_errors.py); Ansible's -u, -b, -l, -e and
`-i a,b,`; usage errors that are no runs in the history; the envelope of every --json document.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fleetctl import __version__
from fleetctl.cli import options
from fleetctl.errors import PatternError, UsageError

ENVELOPE = ("schema_version", "run_id", "exit_code")


def cli(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """`python -m fleetctl.cli ARGS` as a user runs it (the console script's module)."""
    return subprocess.run([sys.executable, "-m", "fleetctl.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200", **(env or {})}, timeout=timeout)


@pytest.fixture
def silent_port():
    """A TCP port on 127.0.0.1 that accepts connections and never says a word (sshd frozen)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    held, stop = [], threading.Event()

    def accept():
        s.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(s.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield s.getsockname()[1]
    stop.set()
    t.join()
    for c in held:
        c.close()
    s.close()


def closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on (bound, then closed: the kernel answers RST)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def inventory(tmp_path: Path, config: str = "", **hosts: dict) -> tuple[Path, Path]:
    """An inventory of `hosts` (name -> vars, as JSON) and an ssh_config whose known_hosts is
    empty and under tmp_path, after the Host blocks `config`; -> (inventory, ssh_config)."""
    inv = tmp_path / "hosts.yaml"
    inv.write_text("all:\n  hosts:\n" + "".join(
        f"    {name}:\n" + "".join(f"      {k}: {json.dumps(v)}\n" for k, v in hv.items()) or f"    {name}:\n"
        for name, hv in hosts.items()))
    (tmp_path / "known_hosts").write_text("")
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"{config}Host *\n  UserKnownHostsFile {tmp_path / 'known_hosts'}\n  GlobalKnownHostsFile none\n")
    return inv, cfg


def inspect_json(tmp_path, inv, cfg, *args: str, timeout_s: float = 1.5):
    """-v inspect all --json on `inv` -> (process, {host: its entry}, the document)."""
    r = cli("-v", "inspect", "all", "-i", str(inv), "--ssh-config", str(cfg), "--connect-timeout", str(timeout_s),
            "--json", "--history", str(tmp_path / "h.sqlite"), *args)
    doc = json.loads(r.stdout)
    return r, {h["host"]: h for h in doc["hosts"]}, doc


# ------------------------------------------------------------------ --version, completion

@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_the_version_and_exits_0(flag):
    r = cli(flag)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"fleetctl {__version__} (Python ")


def test_shell_completion_is_typers_and_completes_commands():
    r = cli("--show-completion", "bash")
    assert r.returncode == 0 and "complete" in r.stdout, r.stderr
    assert "--install-completion" in cli("--help").stdout
    # what the installed completion script asks: the words of a partly typed command line
    done = subprocess.run([sys.executable, "-c", "import sys; sys.argv[0] = 'fleetctl'; "
                           "from fleetctl.cli import main; main()"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "_FLEETCTL_COMPLETE": "complete_bash", "COMP_WORDS": "fleetctl ins",
                               "COMP_CWORD": "1"})
    assert done.stdout.split() == ["inspect"], done.stdout + done.stderr


# ------------------------------------------------------------------ connection errors, -v

def test_a_refused_port_names_sshd_and_ansible_port(tmp_path):
    port = closed_port()
    inv, cfg = inventory(tmp_path, closed={"ansible_host": "127.0.0.1", "ansible_port": port, "ansible_user": "fleet"})
    r, hosts, _ = inspect_json(tmp_path, inv, cfg)
    assert r.returncode == 3
    assert hosts["closed"]["error"] == (f"connection refused on 127.0.0.1:{port}: is sshd listening there? "
                                        "check ansible_port (or Port in ssh_config) and ansible_host")
    assert "Errno" not in r.stdout
    quiet = cli("inspect", "all", "-i", str(inv), "--ssh-config", str(cfg), "--json", "--no-history")
    assert quiet.returncode == 3 and "dialling" not in quiet.stderr  # the trace only with -v
    # the OpenSSH kind keeps ssh's own words and adds the same fix
    r, hosts, _ = inspect_json(tmp_path, inv, cfg, "-c", "ssh")
    assert hosts["closed"]["error"].endswith(f"port {port}: Connection refused: is sshd listening there? check "
                                             "ansible_port (or Port in ssh_config) and ansible_host"), hosts
    assert f"closed: dialling fleet@127.0.0.1:{port} over ssh (OpenSSH)" in r.stderr


def test_a_listener_without_banner_names_the_banner_phase_and_v_shows_each_phase(tmp_path, silent_port):
    inv, cfg = inventory(tmp_path, silent={"ansible_host": "127.0.0.1", "ansible_port": silent_port,
                                           "ansible_user": "fleet"})
    started = time.monotonic()
    r, hosts, _ = inspect_json(tmp_path, inv, cfg, timeout_s=1.5)
    assert time.monotonic() - started < 30
    error = hosts["silent"]["error"]
    assert error.startswith("stalled in the banner phase after 1.") and "(connect timeout 1.5 s)" in error, error
    assert f"TCP to 127.0.0.1:{silent_port} is open but no SSH banner came" in error
    assert "DNS answer, TCP connect" not in error  # one phase, not the six candidates
    # -v: what was dialled, then each phase's time up to the one that stalled (stderr only)
    assert (f"fleetctl: silent: dialling fleet@127.0.0.1:{silent_port} over paramiko; proxy none (direct); "
            "identity files ") in r.stderr
    line = next(x for x in r.stderr.splitlines() if x.startswith("fleetctl: silent: not connected"))
    assert "(resolve 0." in line and ", connect 0." in line and ", banner 1." in line and "kex" not in line, line


def test_a_proxy_command_that_exits_says_its_exit_and_stderr_at_once(tmp_path):
    proxy = "sh -c 'echo \"bastion.example: Connection refused\" >&2; exit 7'"
    inv, cfg = inventory(tmp_path, f"Host proxied\n  ProxyCommand {proxy}\n", proxied={})
    started = time.monotonic()
    r, hosts, _ = inspect_json(tmp_path, inv, cfg, timeout_s=20)
    assert time.monotonic() - started < 15  # not the connect timeout: the proxy's exit is seen at once
    assert hosts["proxied"]["error"] == (f"ProxyCommand `{proxy}` exited 7 before an SSH session: "
                                         "bastion.example: Connection refused: fix ProxyCommand in ssh_config")
    assert "proxy ProxyCommand sh -c" in r.stderr and "Traceback" not in r.stderr


# ------------------------------------------------------------------ Ansible's habits

def test_a_comma_list_is_an_inventory_of_those_hosts(tmp_path):
    loaded = options.load_inventory("gpu-01,10.213.250.5:2222,[fe80::1]:2200,")
    assert [(h.name, h.port) for h in loaded.select("all")] == [("gpu-01", None), ("10.213.250.5", 2222),
                                                                  ("fe80::1", 2200)]
    assert [h.name for h in options.load_inventory("only-one,").select("ungrouped")] == ["only-one"]
    r = cli("hosts", "all", "-i", "gpu-01,gpu-02,", "--json")
    assert r.returncode == 0, r.stderr
    assert [h["host"] for h in json.loads(r.stdout)["hosts"]] == ["gpu-01", "gpu-02"]


def test_u_and_b_are_under_the_inventory_and_e_over_it_as_in_ansible(tmp_path):
    inv, _ = inventory(tmp_path, own={"ansible_user": "sglang", "ansible_become": False, "ansible_port": 22},
                       bare={})
    extra = tmp_path / "extra.yaml"
    extra.write_text("ansible_port: 2202\nfleetctl_sglang_port: 31000\n")
    hosts = {h.name: h for h in options.load_inventory(str(inv), cli=options.command_line_vars(
        "ops", True, ["ansible_port=2201 fleetctl_note='a b'", f"@{extra}"])).select("all")}
    # -u / -b: only where the inventory says nothing (Ansible: command-line values lose to any var)
    assert (hosts["own"].user, hosts["own"].become) == ("sglang", False)
    assert (hosts["bare"].user, hosts["bare"].become) == ("ops", True)
    # -e: over everything, later ones winning, each value's origin named
    assert hosts["own"].port == hosts["bare"].port == 2202 and hosts["bare"].sglang_port == 31000
    assert hosts["own"].vars["fleetctl_note"] == "a b"
    assert hosts["own"].where["ansible_port"] == f"-e @{extra} ({extra})"
    inline = options.command_line_vars(extra_vars=['{"ansible_port": 2203}'])
    assert options.load_inventory(str(inv), cli=inline).select("own")[0].port == 2203


@pytest.mark.parametrize("given, said", [
    ("novalue", "-e novalue: want key=value words, @FILE or a JSON mapping (not 'novalue')"),
    ("@/nonexistent/extra.yaml", "-e @/nonexistent/extra.yaml: cannot read /nonexistent/extra.yaml: No such file"),
    ("[1, 2]", "-e [1, 2]: want key=value words"),
    ("{a: [}", "-e {a: [}:1: not YAML or JSON"),
])
def test_a_bad_extra_var_is_a_usage_error_naming_it(given, said):
    with pytest.raises(UsageError) as e:
        options.command_line_vars(extra_vars=[given])
    assert str(e.value).startswith(said), str(e.value)


def test_a_bad_extra_var_port_names_the_e_that_set_it(tmp_path):
    inv, _ = inventory(tmp_path, a={})
    r = cli("hosts", "all", "-i", str(inv), "-e", "ansible_port=twenty")
    assert r.returncode == 4 and "-e ansible_port=twenty: ansible_port must be a port number" in r.stderr, r.stderr


def test_limit_narrows_the_pattern_and_refuses_when_nothing_is_left(tmp_path):
    inv, _ = inventory(tmp_path, **{f"gpu-0{i}": {} for i in range(1, 5)})
    loaded = options.load_inventory(str(inv))
    assert [h.name for h in options.limited(loaded, "all", "gpu-02:gpu-03")] == ["gpu-02", "gpu-03"]
    assert [h.name for h in options.limited(loaded, "gpu-01:gpu-04", "all:!gpu-01")] == ["gpu-04"]
    with pytest.raises(PatternError, match="--limit gpu-03: none of the 2 host"):
        options.limited(loaded, "gpu-01:gpu-02", "gpu-03")
    r = cli("hosts", "all", "-i", str(inv), "-l", "gpu-04", "--json")
    assert [h["host"] for h in json.loads(r.stdout)["hosts"]] == ["gpu-04"]


# ------------------------------------------------------------------ history and --json

def test_usage_errors_are_no_runs_and_a_run_carries_its_id_and_exit_code(tmp_path):
    history = tmp_path / "h.sqlite"
    port = closed_port()
    inv, cfg = inventory(tmp_path, closed={"ansible_host": "127.0.0.1", "ansible_port": port})
    base = ("-i", str(inv), "--ssh-config", str(cfg), "--history", str(history))
    for args in (("status", "nomatch", *base), ("status", "all", "-l", "nomatch", *base),
                 ("status", "all", "-e", "novalue", *base), ("status", "all", "--forks", "0", *base),
                 ("apply", "defrag-tier0", "all", "--serial", "0", "--check", *base),
                 ("status", "all", "--history", str(history), "-i", str(tmp_path / "missing.yaml"))):
        r = cli(*args)
        assert r.returncode in (4, 5), (args, r.stderr)
        assert not history.exists(), f"{args} was recorded as a run"
    r = cli("status", "all", "--json", *base)
    doc = json.loads(r.stdout)
    assert r.returncode == 3 and (doc["schema_version"], doc["exit_code"]) == (1, 3)
    listed = json.loads(cli("history", "list", "--json", "--history", str(history)).stdout)
    assert [run["run_id"] for run in listed["runs"]] == [doc["run_id"]]
    shown = json.loads(cli("history", "show", "last", "--json", "--history", str(history)).stdout)
    assert (shown["run_id"], shown["exit_code"], shown["schema_version"]) == (doc["run_id"], 3, 1)


def test_every_json_document_has_the_envelope(tmp_path):
    inv, cfg = inventory(tmp_path, closed={"ansible_host": "127.0.0.1", "ansible_port": closed_port()})
    for args in (("inspect", "all"), ("status", "all"), ("validate", "all"), ("cache", "clear", "all"),
                 ("rollback", "--last", "all", "--yes"), ("recover", "all", "--yes")):
        r = cli(*args, "-i", str(inv), "--ssh-config", str(cfg), "--json", "--no-history")
        doc = json.loads(r.stdout)
        assert list(doc)[:3] == list(ENVELOPE), args
        assert (doc["schema_version"], doc["run_id"], doc["exit_code"]) == (1, None, r.returncode == 3 and 3), args
    r = cli("hosts", "all", "-i", str(inv), "--ssh-config", str(cfg), "--json")
    assert {k: json.loads(r.stdout)[k] for k in ENVELOPE} == {"schema_version": 1, "run_id": None, "exit_code": 0}
