"""The recorded lab sequence (tests/golden/history/, written by its record.py) as run history: each
step's `--json` document as the RunRecord history.record would have stored for it, and a real
history file (history.store) holding them, for the HTML report's tests; and every byte a history
file holds (stored_bytes), for the tests that grep it for secrets."""

from __future__ import annotations

import json
import sqlite3
import time
import zlib
from pathlib import Path

from fleetctl.history.model import HostRecord, RunRecord, RunState
from fleetctl.history.store import Store

RECORDED = Path(__file__).resolve().parent / "golden" / "history"


def command_of(argv: list[str]) -> str:
    """The command words of a fleetctl argv ("deploy kernel", else the first word)."""
    return " ".join(argv[:2]) if argv[0] == "deploy" else argv[0]


def recorded_runs() -> list[RunRecord]:
    """One finished RunRecord per recorded step, oldest first: run id as history.record makes
    them (UTC start, then the step's name), argv with "fleetctl" first, exit code and times as
    recorded, the document without its hosts as `doc` and each host's entry as its `doc`."""
    runs = []
    for f in sorted(RECORDED.glob("*.json")):
        rec = json.loads(f.read_text())
        doc = dict(rec["doc"])
        hosts = [HostRecord(h["host"], h["address"], h["status"], h["error"], h["elapsed_s"], h)
                 for h in doc.pop("hosts")]
        rid = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(rec["started_at"])) + "-" + f.stem.split("-", 1)[0]
        runs.append(RunRecord(rid, command_of(rec["argv"]), ["fleetctl", *rec["argv"], "--json"], "root", "vm",
                              "0.1.0", rec["started_at"], rec["ended_at"], rec["exit"], RunState.FINISHED, doc,
                              hosts))
    return runs


def write_store(path: Path, runs: list[RunRecord]) -> Path:
    """A history file at `path` holding `runs` (Store.start, then Store.end with their docs)."""
    store = Store.open(path)
    try:
        for r in runs:
            store.start(r.run_id, r.command, r.argv, r.user, r.control_host, r.version, r.started_at, 1, None)
            store.end(r.run_id, r.exit_code, r.ended_at, r.doc, [h.doc for h in r.hosts])
    finally:
        store.close()
    return path


def stored_bytes(path: Path) -> bytes:
    """The history file's raw bytes and its -wal's, then every blob decompressed (what a reader
    of the file could get)."""
    path = Path(path)
    raw = b"".join(p.read_bytes() for p in (path, path.with_name(path.name + "-wal")) if p.exists())
    conn = sqlite3.connect(path)
    try:
        return raw + b"".join(zlib.decompress(z) for (z,) in conn.execute("SELECT zlib FROM blobs"))
    finally:
        conn.close()
