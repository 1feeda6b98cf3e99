"""The soak's history check (bench/soak.py check_history), on a history file of its own making (the
soak reads the history with sqlite3 alone, never through fleetctl's code). Regression of what the
CI soak's seed 412 step 11 showed: a SIGKILL that lands after a rollback printed its result and
recorded exit 0 is no violation; a run killed before it printed must have no recorded end. And
its tree check (tree_state): pristine, or each playbook's files wholly patched."""

from __future__ import annotations

import importlib.util
import sqlite3
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]


def load_soak():
    spec = importlib.util.spec_from_file_location("fleetctl_soak_unit", ROOT / "bench" / "soak.py")
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def history(path: Path, rows) -> Path:
    """A history file with a `runs` table of (pid, started_at, ended_at, exit_code) rows, the
    columns the soak reads (history/store.py's schema has more)."""
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE runs (pid INTEGER, started_at REAL, ended_at REAL, exit_code INTEGER)")
    con.executemany("INSERT INTO runs VALUES (?, ?, ?, ?)", rows)
    con.commit()
    con.close()
    return path


def soak_with(tmp_path, rows, started):
    mod = load_soak()
    lab = SimpleNamespace(hosts=["h1", "h2"], status=[{"name": "h1", "release": "0.5.23"}], env={}, container_host="h2")
    soak = mod.Soak(lab, 1, history(tmp_path / "history.sqlite", rows), log=lambda line: None)
    soak.started = started
    soak.fig.runs = len(started)
    soak.check_history()
    return soak.fig


def test_a_kill_after_the_run_printed_its_result_is_checked_against_what_it_printed(tmp_path):
    # pid 7: SIGKILLed after printing exit_code 0 and recording its end with 0 (seed 412 step 11)
    fig = soak_with(tmp_path, [(7, 100.0, 104.0, 0)], [(7, 100.0, 105.0, "killed-sigkill", -9, 0)])
    assert fig.violations == [] and fig.late_kills == 1
    # what it recorded differs from what it printed: a violation
    (tmp_path / "b").mkdir()
    fig = soak_with(tmp_path / "b", [(7, 100.0, 104.0, 2)], [(7, 100.0, 105.0, "killed-sigkill", -9, 0)])
    assert [k for _, k, _ in fig.violations] == ["history"]


def test_a_run_killed_before_it_printed_must_have_no_recorded_end(tmp_path):
    fig = soak_with(tmp_path, [(7, 100.0, 104.0, 0)], [(7, 100.0, 105.0, "killed-sigkill", -9, None)])
    assert [(k, t) for _, k, t in fig.violations] == [("history", "pid 7 SIGKILLed but recorded as ended, exit 0")]
    (tmp_path / "b").mkdir()
    fig = soak_with(tmp_path / "b", [(7, 100.0, None, None)], [(7, 100.0, 105.0, "killed-sigkill", -9, None)])
    assert fig.violations == [] and fig.late_kills == 0


def test_a_tree_is_pristine_or_each_playbook_wholly_patched():
    # bench/soak.py tree_state: defrag-tier0 patches a file, route-verify-attention patches one and
    # adds its hook module; any mix of whole playbooks is a known state, nothing else is
    mod = load_soak()
    base = {"a.py": "A0", "b.py": "B0", "c.py": "C0"}
    known = {"defrag-tier0": {"a.py": "A1"}, "route-verify-attention": {"b.py": "B1", "hook.py": "H1"}}
    assert mod.tree_state(base, known, dict(base)) == (set(), [])
    both = {**base, "a.py": "A1", "b.py": "B1", "hook.py": "H1"}
    assert mod.tree_state(base, known, both) == ({"a.py", "b.py", "hook.py"}, [])
    assert mod.tree_state(base, known, {**base, "a.py": "A1"}) == ({"a.py"}, [])
    # the hook module without its import: route-verify-attention partly patched
    assert mod.tree_state(base, known, {**base, "hook.py": "H1"})[1] == [
        "route-verify-attention partly patched: ['hook.py'] of ['b.py', 'hook.py']"]
    # a file no playbook adds, a file lost, a file in a third state
    assert mod.tree_state(base, known, {**base, "x.tmp": "X"})[1] == ["x.tmp added"]
    assert mod.tree_state(base, known, {"a.py": "A0", "b.py": "B0"})[1] == ["c.py lost"]
    assert mod.tree_state(base, known, {**base, "a.py": "A2"})[1] == [
        "a.py hashes to neither its pristine nor a patched state (A2: pristine A0, patched A1)"]
    # a hook module with other bytes than route-verify-attention writes
    assert mod.tree_state(base, known, {**both, "hook.py": "H2"})[1] == ["hook.py added with bytes no playbook writes"]
