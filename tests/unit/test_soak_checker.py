"""The soak's history check (bench/soak.py check_history), on a history file of its own making (the
soak reads the history with sqlite3 alone, never through fleetctl's code). Regression of what the
CI soak's seed 412 step 11 showed: a SIGKILL that lands after a rollback printed its result and
recorded exit 0 is no violation; a run killed before it printed must have no recorded end."""

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
    lab = SimpleNamespace(hosts=["h1"], status=[{"name": "h1", "release": "0.5.23"}], env={})
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
