"""The run store: one SQLite file on the control node (the standard library's sqlite3, no server).

Where: `default_path()`, `${XDG_STATE_HOME:-~/.local/state}/fleetctl/history.sqlite` (XDG's place
for state such as history), unless `--history PATH` / `$FLEETCTL_HISTORY` names another file; the
directory fleetctl creates is 0700 and the file 0600 (it holds hostnames, diffs and errors).
WAL journal and a busy timeout of BUSY_TIMEOUT_MS, so that concurrent runs each write theirs.

The file's schema version is `PRAGMA user_version`: a file of an older version is migrated
forward, step by step (MIGRATIONS), in one transaction; a newer one is refused ("upgrade
fleetctl"). Version 1's tables:
- `runs`: one row per run (the RunRecord fields; `pid` and `pid_started`, the recording
  process and its start time in clock ticks since boot, tell a dead recorder from a live one,
  where `control_host`, `boot_id` and `pid_ns` (version 2: boot_id() and pid_namespace() of
  the recorder) are this process's too);
  `doc` is the run's `--json` document without its hosts (JSON text).
- `hosts`: one row per host of a run, in the command's order, with its address, status, error,
  elapsed seconds and change ids (a JSON list: model.HostRecord.change_ids) as columns, and
  `doc`, the sha256 of its `--json` entry in `blobs` with its long strings (LONG_TEXT
  characters and more: diffs, plans' texts) cut out.
- `pieces`: those long strings, each (run, host, JSON path) naming a blob; a diff seen on ten
  hosts is one blob (as ARA's FileContent dedupes files by their hash).
- `blobs`: sha256 -> the zlib-compressed UTF-8 text, each content stored once.

The store writes what it is given; redacting it is record's (everything passes through
probes.redact there first). Every failure is a HistoryError (exit code 4) naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import socket
import sqlite3
import stat
import time
import zlib
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..errors import EXIT_PARSE, FleetctlError
from ..vocab import HostStatus
from .model import HostRecord, RunRecord, RunState

BUSY_TIMEOUT_MS = 5000
LONG_TEXT = 256  # strings of a host's doc this long or longer are stored as deduplicated blobs
SCHEMA = 2

# MIGRATIONS[v]: the statements that take a file of version v to version v + 1 (v 0: a new,
# empty file). Append a step for each schema change; never edit a released one.
MIGRATIONS: dict[int, list[str]] = {
    0: [
        "CREATE TABLE blobs (sha256 TEXT PRIMARY KEY, zlib BLOB NOT NULL)",
        """CREATE TABLE runs (
             id TEXT PRIMARY KEY, command TEXT NOT NULL, argv TEXT NOT NULL, user TEXT NOT NULL,
             control_host TEXT NOT NULL, version TEXT NOT NULL, pid INTEGER NOT NULL, pid_started TEXT,
             started_at REAL NOT NULL, ended_at REAL, exit_code INTEGER, doc TEXT)""",
        """CREATE TABLE hosts (
             run_id TEXT NOT NULL REFERENCES runs(id) ON DELETE CASCADE, seq INTEGER NOT NULL,
             host TEXT NOT NULL, address TEXT NOT NULL, status TEXT NOT NULL, error TEXT,
             elapsed_s REAL NOT NULL, change_ids TEXT NOT NULL, doc TEXT NOT NULL REFERENCES blobs(sha256),
             PRIMARY KEY (run_id, seq))""",
        """CREATE TABLE pieces (
             run_id TEXT NOT NULL, seq INTEGER NOT NULL, path TEXT NOT NULL,
             sha256 TEXT NOT NULL REFERENCES blobs(sha256),
             FOREIGN KEY (run_id, seq) REFERENCES hosts(run_id, seq) ON DELETE CASCADE)""",
        "CREATE INDEX runs_started ON runs(started_at)",
        "CREATE INDEX hosts_host ON hosts(host, run_id)",
        "CREATE INDEX pieces_host ON pieces(run_id, seq)",
    ],
    1: [  # where the recorder's pid means something: its boot and its pid namespace (see _state)
        "ALTER TABLE runs ADD COLUMN boot_id TEXT",
        "ALTER TABLE runs ADD COLUMN pid_ns INTEGER",
    ],
}


class HistoryError(FleetctlError):
    """The history file cannot be used: not writable, locked past the busy timeout, not a
    SQLite file, of a newer schema, or no such run. The message names the file."""

    exit_code = EXIT_PARSE


def default_path() -> Path:
    """`${XDG_STATE_HOME:-~/.local/state}/fleetctl/history.sqlite` (an XDG_STATE_HOME that is not
    absolute is ignored, as the XDG spec says)."""
    state = os.environ.get("XDG_STATE_HOME", "")
    base = Path(state) if os.path.isabs(state) else Path.home() / ".local" / "state"
    return base / "fleetctl" / "history.sqlite"


def process_started(pid: int) -> str | None:
    """When process `pid` started, in clock ticks since boot (field 22 of /proc/PID/stat), or
    None when there is no such process (or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _make_dirs(directory: Path) -> None:
    """`directory` and each missing parent made, each 0700 whatever the umask; one another
    process makes at the same moment is taken as made."""
    missing = []
    d = directory
    while not os.path.lexists(d):
        missing.append(d)
        d = d.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue
        os.chmod(d, 0o700)


def _private_file(p: Path) -> int:
    """A descriptor of the history file `p` (O_RDWR, created 0600 when missing), after checking
    that nobody else can swap it: its directory (made as needed: _make_dirs) is a directory
    owned by this user and not group- or world-writable; `p` is not a symlink (O_NOFOLLOW) and
    is a regular file owned by this user (a looser mode is made 0600); its -wal and -shm, where
    they exist, are regular files owned by this user, not symlinks. Raises HistoryError naming
    what is wrong, OSError."""
    _make_dirs(p.parent)
    d = os.stat(p.parent)
    euid = os.geteuid()
    if not stat.S_ISDIR(d.st_mode):
        raise HistoryError(f"history {p}: {p.parent} is not a directory")
    if d.st_uid != euid:
        raise HistoryError(f"history {p}: its directory {p.parent} is owned by uid {d.st_uid}, not this user "
                           f"({euid}): use --history PATH in a directory of yours, or --no-history")
    if d.st_mode & 0o022:
        raise HistoryError(f"history {p}: its directory {p.parent} is group- or world-writable "
                           f"({stat.S_IMODE(d.st_mode):o}): chmod go-w it, or use --history PATH, or --no-history")
    for side in (p.with_name(p.name + "-wal"), p.with_name(p.name + "-shm")):
        _own_regular(p, side, os.lstat(side) if os.path.lexists(side) else None)
    try:
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise HistoryError(f"history {p}: is a symbolic link; fleetctl opens no history through one") from None
        raise
    try:
        st = os.fstat(fd)
        _own_regular(p, p, st)
        if stat.S_IMODE(st.st_mode) != 0o600:
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _own_regular(p: Path, f: Path, st: os.stat_result | None) -> None:
    if st is None:
        return
    if stat.S_ISLNK(st.st_mode):
        raise HistoryError(f"history {p}: {f}: is a symbolic link; fleetctl opens no history through one")
    if not stat.S_ISREG(st.st_mode):
        raise HistoryError(f"history {p}: {f}: is not a regular file")
    if st.st_uid != os.geteuid():
        raise HistoryError(f"history {p}: {f}: owned by uid {st.st_uid}, not this user ({os.geteuid()})")


def boot_id() -> str | None:
    """This boot's id (/proc/sys/kernel/random/boot_id: new at each boot), None without /proc."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def pid_namespace() -> int | None:
    """This process's pid namespace, as the inode of /proc/self/ns/pid (None without /proc): two
    processes' pids are comparable only in the same one (another container shares the boot)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _cut(value: Any, path: list, pieces: list[tuple[list, str]]) -> Any:
    """`value` with each string of LONG_TEXT characters or more replaced by None, appended to
    `pieces` as (its JSON path, the string)."""
    if isinstance(value, str) and len(value) >= LONG_TEXT:
        pieces.append((path, value))
        return None
    if isinstance(value, dict):
        return {k: _cut(v, path + [k], pieces) for k, v in value.items()}
    if isinstance(value, list):
        return [_cut(v, path + [i], pieces) for i, v in enumerate(value)]
    return value


def change_ids(value: Any) -> list[str]:
    """Every string under a "change_id" key anywhere in `value` (a JSON document), in order, once each."""
    found: list[str] = []

    def walk(v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                if k == "change_id" and isinstance(x, str) and x not in found:
                    found.append(x)
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    walk(value)
    return found


def _seconds(value: Any) -> float:
    """A host's elapsed seconds for its NOT NULL column: 0.0 for none and for what is not a finite
    number (NaN, inf: SQLite would store NULL and refuse the whole end); its doc keeps the value."""
    try:
        seconds = float(value or 0.0)
    except (TypeError, ValueError):
        return 0.0
    return seconds if math.isfinite(seconds) else 0.0


def _put(doc: Any, path: list, text: str) -> None:
    for step in path[:-1]:
        doc = doc[step]
    doc[path[-1]] = text


class Store:
    """An open history file (use `Store.open`). Not shared between threads."""

    def __init__(self, path: Path, conn: sqlite3.Connection):
        self.path, self._conn = path, conn
        self.damaged: list[str] = []  # what the last `runs` left out: one HistoryError message per damaged run

    @classmethod
    def open(cls, path: str | os.PathLike | None = None, readonly: bool = False) -> "Store":
        """The store in `path` (default_path() when None), created (each directory made 0700,
        the file 0600) and migrated to SCHEMA as needed; with `readonly` (the readers: `history
        list`/`show`, the report) opened read-only, never created nor migrated. Raises
        HistoryError: a newer schema ("upgrade fleetctl"), a file that is not a SQLite database,
        one that cannot be created or written, one locked past the busy timeout, a place that is
        not private (_private_file: a symlink, another user's file or directory, a group- or
        world-writable directory), and with `readonly` a missing file or one without a history
        (an older history is migrated first, as a writer would)."""
        p = Path(path) if path is not None else default_path()
        if readonly:
            return cls._open_readonly(p)
        try:
            fd = _private_file(p)
            try:
                conn = sqlite3.connect(p, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
                now = os.stat(p)
                then = os.fstat(fd)
                if (now.st_dev, now.st_ino) != (then.st_dev, then.st_ino):
                    conn.close()
                    raise HistoryError(f"history {p}: was replaced while it was being opened")
            finally:
                os.close(fd)
        except (OSError, sqlite3.Error) as e:
            raise HistoryError(f"history {p}: {e}") from None
        store = cls(p, conn)
        try:
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            store._setup(time.monotonic() + BUSY_TIMEOUT_MS / 1000)
        except sqlite3.Error as e:
            conn.close()
            raise HistoryError(f"history {p}: {e}") from None
        except HistoryError:
            conn.close()
            raise
        return store

    @classmethod
    def _open_readonly(cls, p: Path) -> "Store":
        if not p.is_file():
            raise HistoryError(f"history {p}: {'not a file' if p.exists() else 'no such file'}"
                               " (a fleet command creates it when it records its first run)")
        try:
            conn = sqlite3.connect(f"{p.absolute().as_uri()}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_MS / 1000,
                                   isolation_level=None)
        except sqlite3.Error as e:
            raise HistoryError(f"history {p}: {e}") from None
        try:
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.Error as e:
            conn.close()
            raise HistoryError(f"history {p}: {e}") from None
        if version != SCHEMA:
            conn.close()
            if 0 < version < SCHEMA:  # an older history: migrated (it exists, nothing is created), then read
                cls.open(p).close()
                return cls._open_readonly(p)
            raise HistoryError(f"history {p}: " + (
                f"its schema is version {version}, newer than this fleetctl's ({SCHEMA}): upgrade fleetctl"
                if version > SCHEMA else "holds no run history (a SQLite file of another kind, or empty)"))
        return cls(p, conn)

    def close(self) -> None:
        self._conn.close()

    def _setup(self, deadline: float) -> None:
        """WAL, foreign keys, the schema. SQLite answers SQLITE_BUSY at once, without its busy
        handler, to a connection that finds another one in WAL recovery or switching the journal
        mode of a new file (seen with two runs starting together on a loaded machine): retried
        until `deadline` (time.monotonic() seconds), then raised."""
        while True:
            try:
                self._conn.execute("PRAGMA journal_mode = WAL")
                self._conn.execute("PRAGMA foreign_keys = ON")
                self._migrate()
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)

    def _migrate(self) -> None:
        """Take the file to SCHEMA, one MIGRATIONS step after the other, in one transaction (a
        second process migrating at once waits, then finds it done)."""
        version = self._conn.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA:
            return
        with self._write():
            version = self._conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA:
                raise HistoryError(f"history {self.path}: its schema is version {version}, newer than this "
                                   f"fleetctl's ({SCHEMA}): upgrade fleetctl (or use --history PATH or --no-history)")
            for v in range(version, SCHEMA):
                for statement in MIGRATIONS[v]:
                    self._conn.execute(statement)
            self._conn.execute(f"PRAGMA user_version = {SCHEMA}")

    @contextlib.contextmanager
    def _write(self) -> Iterator[None]:
        """A write transaction (BEGIN IMMEDIATE: the write lock is taken up front, so two writers
        wait for each other instead of failing on an upgrade from a read lock)."""
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def _blob(self, text: str) -> str:
        sha = _sha(text)
        self._conn.execute("INSERT OR IGNORE INTO blobs (sha256, zlib) VALUES (?, ?)",
                           (sha, zlib.compress(text.encode(), 6)))
        return sha

    def _text(self, sha: str) -> str:
        row = self._conn.execute("SELECT zlib FROM blobs WHERE sha256 = ?", (sha,)).fetchone()
        if row is None:
            raise HistoryError(f"history {self.path}: blob {sha} is missing")
        return zlib.decompress(row[0]).decode()

    def start(self, run_id: str, command: str, argv: list[str], user: str, control_host: str, version: str,
              started_at: float, pid: int, pid_started: str | None, boot: str | None = None,
              pid_ns: int | None = None) -> None:
        """Record a run's start (its fields: model.RunRecord; pid and pid_started: the recording
        process, see process_started; `boot` and `pid_ns`: its boot_id() and pid_namespace(),
        None where unknown). Raises HistoryError."""
        try:
            with self._write():
                self._conn.execute(
                    "INSERT INTO runs (id, command, argv, user, control_host, version, pid, pid_started, started_at,"
                    " boot_id, pid_ns) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (run_id, command, json.dumps(argv), user, control_host, version, pid, pid_started, started_at,
                     boot, pid_ns))
        except sqlite3.Error as e:
            raise HistoryError(f"history {self.path}: {e}") from None

    def end(self, run_id: str, exit_code: int, ended_at: float, doc: dict | None = None,
            hosts: Iterable[dict] = (), argv: list[str] | None = None) -> None:
        """Record a run's end: its exit code, end time (Unix seconds), the run's `--json`
        document without "hosts" (`doc`), and each host's entry in it (`hosts`, in order; each
        has host, address, status, error, elapsed_s); `argv`, when given, replaces the command
        line recorded at its start. Raises HistoryError."""
        try:
            with self._write():
                self._conn.execute("UPDATE runs SET ended_at = ?, exit_code = ?, doc = ? WHERE id = ?",
                                   (ended_at, exit_code, json.dumps(doc or {}, default=str), run_id))
                if argv is not None:
                    self._conn.execute("UPDATE runs SET argv = ? WHERE id = ?", (json.dumps(argv), run_id))
                for seq, h in enumerate(hosts):
                    pieces: list[tuple[list, str]] = []
                    skeleton = json.dumps(_cut(h, [], pieces), default=str)
                    self._conn.execute(
                        "INSERT INTO hosts (run_id, seq, host, address, status, error, elapsed_s, change_ids, doc)"
                        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (run_id, seq, str(h.get("host")), str(h.get("address") or ""), str(h.get("status")),
                         h.get("error"), _seconds(h.get("elapsed_s")), json.dumps(change_ids(h)),
                         self._blob(skeleton)))
                    self._conn.executemany("INSERT INTO pieces (run_id, seq, path, sha256) VALUES (?, ?, ?, ?)",
                                           [(run_id, seq, json.dumps(p), self._blob(t)) for p, t in pieces])
        except sqlite3.Error as e:
            raise HistoryError(f"history {self.path}: {e}") from None

    def runs(self, since: float | None = None, host: str | None = None, command: str | None = None,
             status: str | None = None, docs: bool = True) -> list[RunRecord]:
        """The recorded runs, oldest first: those started at `since` (Unix seconds) or later, with
        a host named `host`, of `command` (its words: "apply", "deploy kernel"), and in `status`:
        a RunState word (running, finished, interrupted) or a HostStatus word (runs with a host
        of that status). With `docs` False the host records' docs are left empty (a listing).
        A damaged run (see `run`) is left out and its error message put in `damaged`.
        Raises HistoryError (a status that is neither)."""
        where, args = [], []
        if since is not None:
            where.append("started_at >= ?")
            args.append(since)
        if host is not None:
            where.append("id IN (SELECT run_id FROM hosts WHERE host = ?)")
            args.append(host)
        if command is not None:
            where.append("command = ?")
            args.append(command)
        if status is not None and status not in {s.value for s in RunState}:
            if status not in {s.value for s in HostStatus}:
                raise HistoryError(f"history: status {status!r} is neither a run's "
                                   f"({', '.join(s.value for s in RunState)}) nor a host's "
                                   f"({', '.join(s.value for s in HostStatus)})")
            where.append("id IN (SELECT run_id FROM hosts WHERE status = ?)")
            args.append(status)
        sql = "SELECT * FROM runs" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY started_at, id"
        try:
            self._conn.row_factory = sqlite3.Row
            rows = self._conn.execute(sql, args).fetchall()
            found, self.damaged = [], []
            for r in rows:
                try:
                    found.append(self._record(r, docs))
                except HistoryError as e:
                    self.damaged.append(str(e))
        except sqlite3.Error as e:
            raise HistoryError(f"history {self.path}: {e}") from None
        finally:
            self._conn.row_factory = None
        return [r for r in found if status is None or status not in {s.value for s in RunState} or r.state == status]

    def run(self, run_id: str) -> RunRecord:
        """The run `run_id` (or the one run whose id starts with it; "last": the latest started),
        with its hosts' docs. Raises HistoryError when none or several match, and for a damaged
        run (a blob that does not decompress, a doc, argv or change ids that are not JSON of
        their shape), naming it."""
        try:
            if run_id == "last":
                ids = [r[0] for r in self._conn.execute("SELECT id FROM runs ORDER BY started_at DESC, id DESC LIMIT 1")]
            else:
                ids = [r[0] for r in self._conn.execute(
                    "SELECT id FROM runs WHERE id = ? OR substr(id, 1, ?) = ? ORDER BY id", (run_id, len(run_id), run_id))]
                ids = [run_id] if run_id in ids else ids
            if len(ids) != 1:
                raise HistoryError(f"history {self.path}: " + (f"no run {run_id}" if not ids else
                                   f"{len(ids)} runs start with {run_id}: {', '.join(ids[:5])}"))
            self._conn.row_factory = sqlite3.Row
            return self._record(self._conn.execute("SELECT * FROM runs WHERE id = ?", ids).fetchone(), True)
        except sqlite3.Error as e:
            raise HistoryError(f"history {self.path}: {e}") from None
        finally:
            self._conn.row_factory = None

    def _record(self, row: sqlite3.Row, docs: bool) -> RunRecord:
        try:
            return self._decoded(row, docs)
        except (zlib.error, ValueError, TypeError, KeyError, IndexError, AttributeError) as e:  # JSON, UTF-8, shapes
            raise HistoryError(f"history {self.path}: run {row['id']} is damaged: {type(e).__name__}: {e}") from None

    def _decoded(self, row: sqlite3.Row, docs: bool) -> RunRecord:
        hosts = []
        for h in self._conn.execute("SELECT * FROM hosts WHERE run_id = ? ORDER BY seq", (row["id"],)).fetchall():
            doc = {}
            if docs:
                doc = json.loads(self._text(h["doc"]))
                for p, sha in self._conn.execute("SELECT path, sha256 FROM pieces WHERE run_id = ? AND seq = ?",
                                                 (row["id"], h["seq"])).fetchall():
                    _put(doc, json.loads(p), self._text(sha))
            hosts.append(HostRecord(h["host"], h["address"], h["status"], h["error"], h["elapsed_s"],
                                    _shaped(doc, dict, "a host's doc"),
                                    _shaped(json.loads(h["change_ids"]), list, "a host's change ids")))
        argv = _shaped(json.loads(row["argv"]), list, "its argv")
        state = _state(row)
        return RunRecord(run_id=row["id"], command=row["command"], argv=[str(a) for a in argv], user=row["user"],
                         control_host=row["control_host"], version=row["version"], started_at=row["started_at"],
                         ended_at=row["ended_at"], exit_code=row["exit_code"], state=state,
                         unverified=state == RunState.RUNNING and not _comparable(row),
                         doc=_shaped(json.loads(row["doc"]), dict, "its doc") if row["doc"] else {}, hosts=hosts)

    def prune(self, older_than_s: float, now: float | None = None) -> int:
        """Delete the runs started more than `older_than_s` seconds before `now` (default: the
        time now) that ended or were interrupted (a running one is kept: its end comes later),
        their hosts and pieces, and the blobs no host or piece names any more; the file is then
        checkpointed and vacuumed. Returns the number of runs deleted. Raises HistoryError."""
        cutoff = (time.time() if now is None else now) - older_than_s
        try:
            with self._write():
                self._conn.row_factory = sqlite3.Row
                try:
                    old = self._conn.execute("SELECT * FROM runs WHERE started_at < ?", (cutoff,)).fetchall()
                finally:
                    self._conn.row_factory = None
                gone = [(r["id"],) for r in old if _state(r) != RunState.RUNNING]
                self._conn.executemany("DELETE FROM runs WHERE id = ?", gone)
                n = len(gone)
                self._conn.execute("DELETE FROM blobs WHERE sha256 NOT IN (SELECT doc FROM hosts) "
                                   "AND sha256 NOT IN (SELECT sha256 FROM pieces)")
            self._conn.execute("VACUUM")
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as e:
            raise HistoryError(f"history {self.path}: {e}") from None
        return n


def _shaped(value: Any, kind: type, what: str) -> Any:
    """`value` when it is a `kind`; else TypeError naming `what` it should have been."""
    if not isinstance(value, kind):
        raise TypeError(f"{what} is {type(value).__name__}, not {kind.__name__}")
    return value


def _comparable(row: sqlite3.Row) -> bool:
    """Whether the run's recorder pid can be looked up here: recorded on this control host, in
    this boot (or none recorded) and this pid namespace (or none recorded)."""
    return (row["control_host"] == socket.gethostname() and row["boot_id"] in (None, boot_id())
            and row["pid_ns"] in (None, pid_namespace()))


def _state(row: sqlite3.Row) -> RunState:
    """FINISHED with an end; without one, INTERRUPTED when it was recorded on this control host
    in an earlier boot (the machine restarted since), RUNNING where its recorder cannot be
    looked up (another control host, another pid namespace: RunRecord.unverified), else RUNNING
    while its recording process lives and INTERRUPTED when it is gone."""
    if row["ended_at"] is not None:
        return RunState.FINISHED
    here = row["control_host"] == socket.gethostname()
    if here and row["boot_id"] is not None and row["boot_id"] != boot_id():
        return RunState.INTERRUPTED
    if not _comparable(row):
        return RunState.RUNNING
    started = process_started(row["pid"])
    alive = started is not None and (row["pid_started"] is None or started == row["pid_started"])
    return RunState.RUNNING if alive else RunState.INTERRUPTED
