"""The run store (history.store) and its recording (history.record) on real SQLite files: the
schema and its version, a real migration step and a newer file refused, an unusable file as one
warning, two processes writing at once, dead recorders shown as interrupted, prune, dedup of
long texts, and planted secrets found nowhere in the file's bytes (compressed blobs included),
by pattern and by value (an inventory's vault values, become passwords, API-key vars); planted
symlinks and loose modes refused, a first use by four processes at once, a signal during the end,
damaged runs named, read-only readers, liveness across boots, pid namespaces and hosts."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
import time
import zlib

import pytest

from fleetctl.cli.history import age_s
from fleetctl.errors import UsageError
from fleetctl.history import record, store as store_mod
from fleetctl.history.model import RunState
from fleetctl.history.store import SCHEMA, HistoryError, Store
from report_runs import stored_bytes

DIFF = "--- a/allocator.py\n+++ b/allocator.py\n" + "".join(f"-x{i} = False\n+x{i} = True\n" for i in range(40))


def host_doc(host: str, status: str = "changed", diff: str = DIFF, **extra) -> dict:
    return {"host": host, "address": f"10.213.31.{10 + int(host[-1])}", "status": status, "error": None,
            "elapsed_s": 1.25, "plan": {"files": [{"path": "/opt/x/allocator.py", "diff": diff}], "edits": [1, 2]},
            **extra}


def recorded(path, command="apply", hosts=(), exit_code=0, started_at=None, doc=None, run_id=None) -> str:
    """Write one finished run straight through the Store API; its id."""
    s = Store.open(path)
    try:
        t = time.time() if started_at is None else started_at
        rid = run_id or record.run_id(t)
        s.start(rid, command, ["fleetctl", command, "all"], "root", "ctl", "0.1.0", t, os.getpid(),
                store_mod.process_started(os.getpid()))
        s.end(rid, exit_code, t + 2, doc or {"change_id": "c-1"}, list(hosts))
        return rid
    finally:
        s.close()



def test_a_new_file_has_the_schema_its_version_wal_and_private_modes(tmp_path):
    path = tmp_path / "state" / "fleetctl" / "history.sqlite"
    s = Store.open(path)
    s.start("r1", "status", [], "root", "ctl", "0.1.0", time.time(), os.getpid(), None)
    wal = path.with_name(path.name + "-wal")
    assert [stat.S_IMODE(p.stat().st_mode) for p in (path.parent, path, wal)] == [0o700, 0o600, 0o600]
    s.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA == 2
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")} == {
        "runs", "hosts", "pieces", "blobs"}


def test_the_default_path_is_xdg_state_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert store_mod.default_path() == tmp_path / "fleetctl" / "history.sqlite"
    monkeypatch.setenv("XDG_STATE_HOME", "relative/dir")  # not absolute: ignored (XDG)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert store_mod.default_path() == tmp_path / "home" / ".local" / "state" / "fleetctl" / "history.sqlite"


def test_an_older_file_is_migrated_step_by_step_and_a_failed_step_changes_nothing(tmp_path, monkeypatch):
    # v0 -> v1: a SQLite file of version 0 (made by someone else, holding a table of its own) gets v1
    path = tmp_path / "h.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE notes (x)")
    conn.commit()
    conn.close()
    rid = recorded(path, hosts=[host_doc("lab-2")])
    # v2 -> v3, a step that adds a column and fills it from the v2 rows
    monkeypatch.setattr(store_mod, "SCHEMA", 3)
    monkeypatch.setitem(store_mod.MIGRATIONS, 2, ["ALTER TABLE runs ADD COLUMN label TEXT",
                                                  "UPDATE runs SET label = command || ':' || exit_code"])
    s = Store.open(path)
    assert s.run(rid).hosts[0].doc == host_doc("lab-2")
    s.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 3
    assert conn.execute("SELECT label FROM runs").fetchall() == [("apply:0",)]
    conn.close()
    # a step that fails half-way leaves the file as it was (one transaction)
    monkeypatch.setattr(store_mod, "SCHEMA", 4)
    monkeypatch.setitem(store_mod.MIGRATIONS, 3, ["ALTER TABLE runs ADD COLUMN other TEXT", "NOT SQL"])
    with pytest.raises(HistoryError, match="syntax error"):
        Store.open(path)
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 3
    assert "other" not in [r[1] for r in conn.execute("PRAGMA table_info(runs)")]


def test_a_newer_file_is_refused_with_upgrade_fleetctl(tmp_path):
    path = tmp_path / "h.sqlite"
    Store.open(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA + 1}")
    conn.close()
    with pytest.raises(HistoryError, match=r"schema is version 3, newer than this fleetctl's \(2\): upgrade fleetctl"):
        Store.open(path)


@pytest.mark.parametrize("spoil", ["corrupt", "newer", "unwritable", "locked"])
def test_an_unusable_file_is_one_warning_and_the_run_goes_on(tmp_path, capsys, monkeypatch, spoil):
    path = tmp_path / "h.sqlite"
    holder = None
    if spoil == "corrupt":
        path.write_bytes(b"this is no SQLite file, " * 100)
    elif spoil == "newer":
        Store.open(path).close()
        sqlite3.connect(path).execute("PRAGMA user_version = 99").connection.close()
    elif spoil == "unwritable":
        (tmp_path / "file").write_text("")
        path = tmp_path / "file" / "h.sqlite"  # its directory is a file: root cannot write it either
    else:
        Store.open(path).close()
        monkeypatch.setattr(store_mod, "BUSY_TIMEOUT_MS", 200)
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
    record.start("status", str(path), ["status", "all"])
    record.results({"hosts": [host_doc("lab-1", "ok")]})
    record.end(0)
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "this run is not recorded in the history" in err, err
    assert str(path) in err
    if holder is not None:
        holder.execute("ROLLBACK")
        assert Store.open(path).runs() == []


def test_two_processes_recording_at_once_both_get_every_run(tmp_path):
    path = tmp_path / "h.sqlite"
    script = textwrap.dedent(f"""
        import sys
        from fleetctl.history import record
        for i in range(25):
            record.start("status", {str(path)!r}, ["status", sys.argv[1]])
            record.results({{"hosts": [{{"host": sys.argv[1], "address": "a", "status": "ok", "error": None,
                                          "elapsed_s": 0.1, "note": "x" * 400 + str(i)}}]}})
            record.end(0)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, f"lab-{n}"], stderr=subprocess.PIPE, text=True)
             for n in (1, 2)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and errs == ["", ""], errs
    s = Store.open(path)
    runs = s.runs()
    assert len(runs) == 50 and len({r.run_id for r in runs}) == 50
    assert {h: len(s.runs(host=h)) for h in ("lab-1", "lab-2")} == {"lab-1": 25, "lab-2": 25}
    assert all(r.state == RunState.FINISHED and r.exit_code == 0 for r in runs)


def test_a_recorder_killed_before_its_end_shows_as_interrupted(tmp_path):
    path = tmp_path / "h.sqlite"
    script = (f"import os, signal; from fleetctl.history import record; record.start('apply', {str(path)!r}, "
              "['apply', 'defrag-tier0', 'all']); os.kill(os.getpid(), signal.SIGKILL)")
    p = subprocess.run([sys.executable, "-c", script])
    assert p.returncode == -signal.SIGKILL
    s = Store.open(path)
    [run] = s.runs()
    assert (run.state, run.ended_at, run.exit_code, run.hosts) == (RunState.INTERRUPTED, None, None, [])
    assert s.runs(status="interrupted") == [run] and s.runs(status="running") == []
    # a live recorder is running; one whose pid now belongs to a process started later is not
    s.start("live", "status", [], "root", store_mod.socket.gethostname(), "0.1.0", time.time(), os.getpid(),
            store_mod.process_started(os.getpid()))
    s.start("reused", "status", [], "root", store_mod.socket.gethostname(), "0.1.0", time.time(), os.getpid(), "1")
    assert {r.run_id: r.state for r in s.runs()}["live"] == RunState.RUNNING
    assert {r.run_id: r.state for r in s.runs()}["reused"] == RunState.INTERRUPTED


def test_filters_and_lookups(tmp_path):
    path = tmp_path / "h.sqlite"
    old = recorded(path, "inspect", [host_doc("lab-1", "ok")], started_at=time.time() - 10 * 86400, run_id="A-old")
    new = recorded(path, "apply", [host_doc("lab-1", "ok"), host_doc("lab-2", "failed")], exit_code=2, run_id="B-new")
    s = Store.open(path)
    ids = lambda **kw: [r.run_id for r in s.runs(**kw)]  # noqa: E731
    assert ids() == [old, new]
    assert ids(since=time.time() - 86400) == [new]
    assert ids(host="lab-2") == [new] and ids(host="lab-9") == []
    assert ids(command="inspect") == [old]
    assert ids(status="failed") == [new] and ids(status="finished") == [old, new]
    with pytest.raises(HistoryError, match="neither a run's"):
        s.runs(status="bogus")
    assert s.run("last").run_id == new and s.run("B-").run_id == new
    assert [h.status for h in s.run(new).hosts] == ["ok", "failed"]
    assert s.runs(docs=False)[1].hosts[1].doc == {}
    with pytest.raises(HistoryError, match="no run Z"):
        s.run("Z")
    recorded(path, run_id="B-newer")
    with pytest.raises(HistoryError, match="2 runs start with B-"):
        s.run("B-")


def test_each_host_names_its_change_ids(tmp_path):
    path = tmp_path / "h.sqlite"
    recorded(path, "status", [dict(host_doc("lab-1", "ok"), change_id="c-2",
                                   changes=[{"change_id": "c-1"}, {"change_id": "c-2"}, {"change_id": 7}])])
    assert Store.open(path).runs(docs=False)[0].hosts[0].change_ids == ["c-2", "c-1"]


def test_long_texts_are_stored_once_compressed_and_read_back_whole(tmp_path):
    path = tmp_path / "h.sqlite"
    hosts = [host_doc(f"lab-{i}", extra_list=[DIFF, "short"]) for i in range(1, 5)]
    rid = recorded(path, hosts=hosts)
    recorded(path, hosts=hosts[:1])
    assert Store.open(path).run(rid).hosts[2].doc == hosts[2]
    conn = sqlite3.connect(path)
    diff_blobs = [z for (z,) in conn.execute("SELECT zlib FROM blobs") if zlib.decompress(z).decode() == DIFF]
    assert len(diff_blobs) == 1  # 10 occurrences in 2 runs, one blob
    assert conn.execute("SELECT count(*) FROM pieces").fetchone()[0] == 10
    assert len(diff_blobs[0]) < len(DIFF) / 4
    assert b"x39 = True" not in path.read_bytes() + path.with_name(path.name + "-wal").read_bytes()


def test_prune_deletes_old_runs_their_hosts_and_the_blobs_only_they_held(tmp_path):
    path = tmp_path / "h.sqlite"
    only_old = DIFF.replace("True", "Maybe")
    recorded(path, hosts=[host_doc("lab-1", diff=only_old), host_doc("lab-2")],
             started_at=time.time() - 100 * 86400, run_id="old")
    recorded(path, hosts=[host_doc("lab-2")], run_id="new")
    s = Store.open(path)
    assert s.prune(90 * 86400) == 1
    assert [r.run_id for r in s.runs()] == ["new"] and s.run("new").hosts[0].doc == host_doc("lab-2")
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT count(*) FROM hosts").fetchone()[0] == 1
    assert conn.execute("SELECT count(*) FROM pieces").fetchone()[0] == 1
    texts = [zlib.decompress(z).decode() for (z,) in conn.execute("SELECT zlib FROM blobs")]
    assert DIFF in texts and only_old not in texts and len(texts) == 2  # new's host doc and its diff
    assert s.prune(90 * 86400) == 0


def test_planted_secrets_are_stored_nowhere(tmp_path, capsys):
    path = tmp_path / "h.sqlite"
    secret = {k: f"{k}-{os.urandom(6).hex()}" for k in ("api", "become", "assign", "bearer", "error", "url", "json")}
    record.start("validate", str(path), ["validate", "all", f"--become-password={secret['become']}",
                                         "--api-key", secret["api"], f"HF_TOKEN={secret['assign']}"])
    servers = [{"pid": 7, "argv": ["python", "-m", "sglang.launch_server", "--api-key", secret["api"],
                                   "--model-path", f"https://u:{secret['url']}@hf.example.invalid/m"],
                "headers": f"Authorization: Bearer {secret['bearer']}", "body": json.dumps({"api_key": secret["json"]}),
                "tail": "x" * 300 + f" password={secret['error']}"}]
    record.results({"hosts": [dict(host_doc("lab-1", "failed"), error=f"sudo said PASSWORD={secret['become']}",
                                   servers=servers)]})
    record.end(2)
    assert capsys.readouterr().err == ""
    data = stored_bytes(path)
    assert b"<redacted>" in data  # the bytes read are the record's: the search below can fail
    assert [k for k, v in secret.items() if v.encode() in data] == []
    run = Store.open(path).run("last")
    assert run.argv == ["fleetctl", "validate", "all", "--become-password=<redacted>", "--api-key", "<redacted>",
                        "HF_TOKEN=<redacted>"]
    assert run.hosts[0].doc["servers"][0]["argv"][3:5] == ["--api-key", "<redacted>"]
    assert run.hosts[0].error == "sudo said PASSWORD=<redacted>" and run.exit_code == 2


def test_ages():
    assert (age_s("90d", "--older-than"), age_s("12h", "x"), age_s("30m", "x"), age_s("2w", "x"),
            age_s("45s", "x"), age_s("1.5", "x")) == (90 * 86400, 43200, 1800, 14 * 86400, 45, 1.5 * 86400)
    with pytest.raises(UsageError, match="--since 7 days: want a number and a unit"):
        age_s("7 days", "--since")


def test_the_history_commands_list_show_with_diffs_and_prune(tmp_path):
    path = tmp_path / "h.sqlite"
    validation = {"status": "passed"}
    recorded(path, "apply", [host_doc("lab-1", "skipped", diff="", skipped_reason="not applicable"),
                             host_doc("lab-2", validation=validation), host_doc("lab-3", validation=validation)],
             doc={"change_id": "20261202T0000Z-defrag-tier0-abc", "check": False}, run_id="R1",
             started_at=time.time() - 3 * 86400)

    def cli(*args):
        r = subprocess.run([sys.executable, "-m", "fleetctl.cli", "history", *args, "--history", str(path)],
                           capture_output=True, text=True, env=dict(os.environ, COLUMNS="200"), timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout

    shown = cli("show", "R")
    assert "run R1: fleetctl apply all" in shown and "diff — lab-2, lab-3" in shown and "+x39 = True" in shown
    assert "change id: 20261202T0000Z-defrag-tier0-abc" in shown and "recap: changed=2 skipped=1" in shown
    assert json.loads(cli("show", "last", "--json"))["hosts"][1] == host_doc("lab-2", validation=validation)
    [listed] = json.loads(cli("list", "--since", "4d", "--json"))["runs"]
    assert (listed["run_id"], [h["status"] for h in listed["hosts"]]) == ("R1", ["skipped", "changed", "changed"])
    assert json.loads(cli("list", "--since", "2d", "--json"))["runs"] == []
    assert json.loads(cli("prune", "--older-than", "2d", "--json")) == {
        "schema_version": 1, "run_id": None, "exit_code": 0, "pruned": 1, "older_than_s": 172800.0}
    assert "R1" not in cli("list")


def test_secret_values_the_inventory_holds_are_stored_nowhere(tmp_path, capsys):
    """A real inventory (a `!vault` value and the restart command rendering it, a become
    password, an API-key var) loaded with a vault password file: every one of those values, and
    the vault password, handed to record (as FleetOptions.select does) is <redacted> wherever it
    appears in the stored run, a key and the command line included."""
    from ansible.parsing.vault import VaultLib, VaultSecret

    from fleetctl.cli.options import load_inventory

    token = os.urandom(6).hex()
    pw, vaulted, become, key = (f"{k}-{token}" for k in ("vaultpw", "VAULTED", "become", "apikey"))
    cipher = VaultLib([("default", VaultSecret(pw.encode()))]).encrypt(vaulted).decode()
    (tmp_path / "pw").write_text(pw + "\n")
    (tmp_path / "hosts.yaml").write_text(textwrap.dedent("""\
        all:
          hosts:
            lab-1:
              ansible_host: 10.213.31.11
              ansible_become_password: {become}
              fleetctl_sglang_api_key: {key}
              fleetctl_restart_cmd: "/opt/restart.sh {{{{ restart_token }}}}"
              restart_token: !vault |
        {cipher}
        """).format(become=become, key=key, cipher=textwrap.indent(cipher, " " * 16)))
    seen: set[str] = set()
    load_inventory(str(tmp_path / "hosts.yaml"), str(tmp_path / "pw"), False, seen)
    assert {pw, vaulted, f"/opt/restart.sh {vaulted}", become, key} <= seen and "10.213.31.11" not in seen
    path = tmp_path / "h.sqlite"
    record.start("apply", str(path), ["apply", "x", "all", f"--note={vaulted}"])
    record.secrets(seen)
    handler = {"name": "restart sglang", "command": f"/opt/restart.sh {vaulted}"}
    record.results({"change_id": None, "check": True, "hosts": [dict(
        host_doc("lab-1", diff=DIFF + f"+cmd = '/opt/restart.sh {vaulted}'\n"), error=f"sudo: {become}",
        handlers=[handler], env={key: "x", "k": key}, note=pw)]})
    record.end(0)
    assert capsys.readouterr().err == ""
    data = stored_bytes(path)
    assert b"<redacted>" in data  # the bytes read are the record's: the search below can fail
    assert [s for s in (pw, vaulted, become, key) if s.encode() in data] == []
    run = Store.open(path).run("last")
    assert run.argv[-1] == "--note=<redacted>" and run.hosts[0].error == "sudo: <redacted>"
    assert run.hosts[0].doc["handlers"] == [{"name": "restart sglang", "command": "<redacted>"}]
    assert run.hosts[0].doc["env"] == {"<redacted>": "x", "k": "<redacted>"}


def _open_error(path) -> str:
    with pytest.raises(HistoryError) as e:
        Store.open(path).close()
    return str(e.value)


def test_a_planted_symlink_or_a_loose_directory_is_refused_and_nothing_written_through_it(tmp_path):
    """The file a symlink (to a missing file, to an empty one, to a text file), its -wal or -shm a
    symlink, its directory group/world-writable: a HistoryError naming why, and the target
    untouched (another user's file or directory: tests/machine/test_history_owner.py, as root). Parents are made 0700 each under a loose umask; a file of ours
    with a loose mode is made 0600."""
    home = tmp_path / "state" / "fleetctl"
    home.mkdir(parents=True, mode=0o700)
    path = home / "history.sqlite"
    targets = {"missing": tmp_path / "cron-x", "empty": tmp_path / "empty", "text": tmp_path / "passwd"}
    targets["empty"].write_text("")
    targets["text"].write_text("root:x:0:0\n")
    for name, target in targets.items():
        path.unlink(missing_ok=True)
        path.symlink_to(target)
        assert "symbolic link" in _open_error(path), name
    assert not targets["missing"].exists() and targets["empty"].read_text() == ""
    assert targets["text"].read_text() == "root:x:0:0\n"
    path.unlink()
    for side in ("-wal", "-shm"):
        link = path.with_name(path.name + side)
        link.symlink_to(targets["empty"])
        assert f"{link}: is a symbolic link" in _open_error(path)
        link.unlink()
    assert targets["empty"].read_text() == ""
    for mode in (0o770, 0o707):
        home.chmod(mode)
        assert "group- or world-writable" in _open_error(path)
    home.chmod(0o700)
    Store.open(path).close()
    path.chmod(0o644)
    Store.open(path).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    old = os.umask(0o277)
    try:
        deep = tmp_path / "a" / "b" / "c" / "h.sqlite"
        Store.open(deep).close()
    finally:
        os.umask(old)
    assert [stat.S_IMODE(p.stat().st_mode) for p in (deep.parents[2], deep.parents[1], deep.parent)] == [0o700] * 3


def test_four_processes_opening_a_missing_directory_at_once_all_record(tmp_path):
    """First use: four processes behind a barrier create the same missing directories and file."""
    path = tmp_path / "x" / "y" / "z" / "h.sqlite"
    script = textwrap.dedent(f"""
        import os, sys, time
        from fleetctl.history import record
        while not os.path.exists({str(tmp_path / "go")!r}):
            time.sleep(0.001)
        record.start("status", {str(path)!r}, ["status", sys.argv[1]])
        record.end(0)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, f"lab-{n}"], stderr=subprocess.PIPE, text=True)
             for n in range(4)]
    time.sleep(1.5)  # each is importing, then waits at the barrier
    (tmp_path / "go").write_text("")
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert errs == [""] * 4 and [p.returncode for p in procs] == [0] * 4
    assert len(Store.open(path).runs()) == 4


def test_readers_open_read_only_and_a_mistyped_path_is_an_error_not_a_new_file(tmp_path):
    path = tmp_path / "h.sqlite"
    recorded(path, "status", [host_doc("lab-1", "ok")], run_id="R1")
    before = path.read_bytes()
    for args in (["list"], ["show", "R1"], ["list", "--json"], ["show", "last", "--json"]):
        r = subprocess.run([sys.executable, "-m", "fleetctl.cli", "history", *args, "--history", str(path)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "R1" in r.stdout, r.stderr
    assert path.read_bytes() == before  # SQLite's read-only WAL reader leaves its -wal/-shm, 0600 as the file
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()} == {
        "h.sqlite": 0o600, "h.sqlite-wal": 0o600, "h.sqlite-shm": 0o600}
    typo = tmp_path / "hsitory.sqlite"
    for args in (["list"], ["show", "last"]):
        r = subprocess.run([sys.executable, "-m", "fleetctl.cli", "history", *args, "--history", str(typo)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 4 and f"history {typo}: no such file" in " ".join(r.stderr.split()), r.stderr
    assert not typo.exists()
    s = Store.open(path, readonly=True)
    with pytest.raises(HistoryError, match="readonly"):
        s.start("R2", "status", [], "root", "ctl", "0.1.0", time.time(), os.getpid(), None)
    s.close()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_end_waits_for_the_lock_changes_no_exit_code(tmp_path, signum):
    """The recorder, with cli's SIGTERM handler (raising KeyboardInterrupt, as Ctrl-C does),
    gets a signal while its end waits out another writer's lock: no traceback, its exit code
    stands, and the end is written once the lock is gone."""
    path, go = tmp_path / "h.sqlite", tmp_path / "go"
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        from fleetctl.cli.signals import on_sigterm
        from fleetctl.history import record
        signal.signal(signal.SIGTERM, on_sigterm)
        record.start("status", {str(path)!r}, ["status", "all"])
        print("started", flush=True)
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        record.end(2)
        sys.exit(2)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "started\n"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    go.write_text("")
    time.sleep(1.0)  # the end is waiting for the lock (BUSY_TIMEOUT_MS: 5 s)
    p.send_signal(signum)
    time.sleep(1.0)
    holder.execute("ROLLBACK")
    holder.close()
    out, err = p.communicate(timeout=30)
    assert (p.returncode, err) == (2, "")
    [run] = Store.open(path).runs()
    assert (run.state, run.exit_code) == (RunState.FINISHED, 2)


def test_prune_keeps_running_runs_and_their_end_is_then_recorded(tmp_path, capsys):
    path = tmp_path / "h.sqlite"
    old = time.time() - 10 * 86400
    recorded(path, "status", [host_doc("lab-1", "ok")], run_id="ENDED", started_at=old)
    s = Store.open(path)
    s.start("LIVE", "apply", [], "root", store_mod.socket.gethostname(), "0.1.0", old, os.getpid(),
            store_mod.process_started(os.getpid()))
    s.start("DEAD", "apply", [], "root", store_mod.socket.gethostname(), "0.1.0", old, os.getpid(), "1")
    assert s.prune(86400) == 2
    assert [(r.run_id, r.state) for r in s.runs()] == [("LIVE", RunState.RUNNING)]
    s.end("LIVE", 0, time.time(), {}, [host_doc("lab-1")])
    assert Store.open(path).run("LIVE").state == RunState.FINISHED
    s.close()


def test_a_failed_end_says_its_end_is_not_recorded(tmp_path, capsys):
    path = tmp_path / "h.sqlite"
    record.start("status", str(path), ["status", "all"])
    sqlite3.connect(path).execute("DROP TABLE pieces").connection.close()  # its end's insert fails
    record.results({"hosts": [host_doc("lab-1", "ok")]})
    record.end(0)
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "its end is not recorded in the history" in err, err


def test_a_host_with_a_non_finite_elapsed_time_keeps_the_rest_of_the_end(tmp_path, capsys):
    path = tmp_path / "h.sqlite"
    record.start("status", str(path), ["status", "all"])
    record.results({"hosts": [dict(host_doc("lab-1", "ok"), elapsed_s=float("nan")),
                              dict(host_doc("lab-2", "ok"), elapsed_s=float("inf")), host_doc("lab-3", "ok")]})
    record.end(0)
    assert capsys.readouterr().err == ""
    run = Store.open(path).run("last")
    assert (run.exit_code, [(h.host, h.elapsed_s) for h in run.hosts]) == (
        0, [("lab-1", 0.0), ("lab-2", 0.0), ("lab-3", 1.25)])  # the column is NOT NULL


@pytest.mark.parametrize("spoil", ["blob", "doc", "argv", "nulldoc", "change_ids"])
def test_a_damaged_run_is_an_error_naming_it_and_the_listing_notes_it(tmp_path, spoil):
    """A blob that does not decompress, a run's doc or argv or a host's change ids that are not
    JSON, a doc of `null`: `history show` of it is a HistoryError (exit 4) naming the run, and
    `history list` lists the others and notes it (a listing reads no blob)."""
    path = tmp_path / "h.sqlite"
    recorded(path, "status", [host_doc("lab-1", "ok")], run_id="GOOD")
    recorded(path, "apply", [host_doc("lab-1")], run_id="BAD", started_at=time.time() + 1)
    conn = sqlite3.connect(path)
    conn.execute({"blob": "UPDATE blobs SET zlib = x'00112233' WHERE sha256 IN (SELECT doc FROM hosts WHERE run_id = 'BAD')",
                  "doc": "UPDATE runs SET doc = '{nope' WHERE id = 'BAD'",
                  "argv": "UPDATE runs SET argv = 'fleetctl x' WHERE id = 'BAD'",
                  "nulldoc": "UPDATE runs SET doc = 'null' WHERE id = 'BAD'",
                  "change_ids": "UPDATE hosts SET change_ids = '[' WHERE run_id = 'BAD'"}[spoil])
    conn.commit()
    conn.close()

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "fleetctl.cli", "history", *args, "--history", str(path)],
                              capture_output=True, text=True, env=dict(os.environ, COLUMNS="200"), timeout=60)

    shown = cli("show", "BAD")
    assert shown.returncode == 4 and "run BAD" in shown.stderr and "Traceback" not in shown.stderr, shown.stderr
    listed = cli("list", "--json")
    assert listed.returncode == 0, listed.stderr
    if spoil == "blob":  # a listing reads no host's doc
        assert [r["run_id"] for r in json.loads(listed.stdout)["runs"]] == ["GOOD", "BAD"]
    else:
        assert [r["run_id"] for r in json.loads(listed.stdout)["runs"]] == ["GOOD"]
        assert "run BAD is damaged" in listed.stderr and "left out" in listed.stderr
    assert cli("show", "GOOD").returncode == 0


def test_show_of_a_command_this_fleetctl_does_not_know_is_a_host_table_with_a_note(tmp_path):
    path = tmp_path / "h.sqlite"
    recorded(path, "drain", [host_doc("lab-1", "ok"), host_doc("lab-2", "failed")], run_id="R1")
    r = subprocess.run([sys.executable, "-m", "fleetctl.cli", "history", "show", "R1", "--history", str(path)],
                       capture_output=True, text=True, env=dict(os.environ, COLUMNS="200"), timeout=60)
    assert r.returncode == 0, r.stderr
    assert "this fleetctl does not know the command drain" in " ".join(r.stdout.split())
    assert "lab-1" in r.stdout and "lab-2" in r.stdout and "recap: failed=1 ok=1" in r.stdout


def test_liveness_is_judged_by_pid_only_on_this_host_boot_and_pid_namespace(tmp_path):
    """A recorder on another control host, or in another pid namespace of this one, cannot be
    looked up: RUNNING, unverified (even where its pid is free here); one of an earlier boot of
    this host is INTERRUPTED (even where its pid is taken here); a v1 file's runs (no boot, no
    namespace) keep the pid rule."""
    path = tmp_path / "h.sqlite"
    s = Store.open(path)
    here, me, boot, ns = store_mod.socket.gethostname(), os.getpid(), store_mod.boot_id(), store_mod.pid_namespace()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    for rid, host, pid, b, n in (("OTHER-HOST", "ctl-b", int(dead), boot, ns), ("OTHER-NS", here, int(dead), boot, ns + 1),
                                 ("OLD-BOOT", here, me, "0" * 8, ns), ("LIVE", here, me, boot, ns),
                                 ("V1", here, int(dead), None, None)):
        s.start(rid, "status", [], "root", host, "0.1.0", time.time(), pid, None, b, n)
    got = {r.run_id: (str(r.state), r.unverified) for r in s.runs()}
    assert got == {"OTHER-HOST": ("running", True), "OTHER-NS": ("running", True), "OLD-BOOT": ("interrupted", False),
                   "LIVE": ("running", False), "V1": ("interrupted", False)}
    s.close()
    r = subprocess.run([sys.executable, "-m", "fleetctl.cli", "history", "list", "--json", "--history", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert {x["run_id"]: x["unverified"] for x in json.loads(r.stdout)["runs"]}["OTHER-NS"] is True
    r = subprocess.run([sys.executable, "-m", "fleetctl.cli", "history", "list", "--history", str(path)],
                       capture_output=True, text=True, env=dict(os.environ, COLUMNS="250"), timeout=60)
    assert "running on ctl-b (unverified)" in r.stdout and f"running on {here} (unverified)" in r.stdout
    record.start("status", str(path), ["status", "all"])
    record.end(0)
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT boot_id, pid_ns FROM runs ORDER BY started_at DESC LIMIT 1").fetchone() == (boot, ns)


@pytest.mark.parametrize("when", ["after", "before"])
def test_a_sigterm_as_the_run_starts_recording_leaves_no_run_running(tmp_path, monkeypatch, when):
    """Soak finding 12 (bench/results/soak-findings.md, seed 6802): the SIGTERM handler's
    KeyboardInterrupt raised right after the run's row was written (`after`) left it "running"
    with no end; `end` now records it (143). Raised before the write (`before`), the run is not in
    the history, and `end` warns of nothing."""
    path = tmp_path / "h.sqlite"
    real = Store.start

    def start_then_signal(self, *a, **kw):
        if when == "after":
            real(self, *a, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(Store, "start", start_then_signal)
    with pytest.raises(KeyboardInterrupt):
        record.start("apply", str(path), ["apply", "defrag-tier0", "all"])
    record.end(143)
    runs = Store.open(path).runs()
    if when == "after":
        [run] = runs
        assert (run.state, run.exit_code) == (RunState.FINISHED, 143)
    else:
        assert runs == []
