"""The diagnose child: what a server wrote, read back as hostile data by a process running as
the server's own uid (run.py starts it with runas.rerun, under the install's interpreter: its
torch reads the recorder's dump).

- the profiler's trace: in the private directory run.py made for this run, the regular files
  (never a link: safefs, O_NOFOLLOW from /) named *.trace.json.gz or *.trace.json, the first by
  name (TP rank 0's: `{profile_id}-TP-0...`, 0.5.23 profiler_manager.py:343-358), at most
  MAX_TRACE bytes on disk and MAX_JSON once decompressed, parsed as JSON and read by
  trace.breakdown;
- the expert recorder's dump: in the server's SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR (given by
  run.py from the server's environment; SGLang's default /tmp: 0.5.23 environ.py), the regular
  files named expert_distribution_recorder_*.pt (0.5.23 eplb/expert_distribution.py:1006)
  modified at or after `since`, of this uid or the server's, at most MAX_DUMP bytes, loaded with
  torch.load(weights_only=True) (tensors and plain containers only: no pickle code runs), read
  by experts.balance; run.py removes the dumps this run caused after.
"""

import importlib
import json
import os
import re
import stat
import zlib

from .. import safefs
from . import experts, trace

MAX_TRACE = 64 << 20
MAX_JSON = 256 << 20
MAX_DUMP = 64 << 20
DUMP_NAME = re.compile(r"^expert_distribution_recorder_[0-9.]+(_\d+)?\.pt$")
TRACE_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,200}\.trace\.json(\.gz)?$")


def _entries(path, owners):
    """(directory descriptor, [(name, lstat)] of its regular files owned by a uid of `owners`) of
    directory `path` reached from / without a link (safefs.open_dir)."""
    dfd = safefs.open_dir(path)
    out = []
    for name in os.listdir(dfd)[:10000]:
        st = safefs.lstat(dfd, name)
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_uid in owners:
            out.append((name, st))
    return dfd, out


def _owners(server_uid):
    """The uids whose files are read: this child's, and the server's (root, when the server runs as
    root: the child then runs as another account, and the files are in a directory only it and
    root may write)."""
    return {os.geteuid()} | ({server_uid} if isinstance(server_uid, int) else set())


def _read(dfd, name, path, limit):
    fd = safefs.open_regular(dfd, name, path, limit)
    with os.fdopen(fd, "rb") as f:
        return f.read(limit + 1)


def _gunzip(data):
    """`data` decompressed (gzip), at most MAX_JSON bytes; ValueError past that."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    out = d.decompress(data, MAX_JSON)
    if d.unconsumed_tail:
        raise ValueError("the trace is over %d bytes decompressed" % MAX_JSON)
    return out


def read_trace(trace_dir, version, speculative, server_uid=None):
    """(trace.breakdown of the trace file, its name) or raises OSError / ValueError /
    safefs.UnsafePath with why (no trace written, too large, not JSON)."""
    dfd, files = _entries(trace_dir, _owners(server_uid))
    try:
        names = sorted(n for n, _ in files if TRACE_NAME.match(n))
        if not names:
            raise ValueError("the server wrote no trace into its private directory")
        name = names[0]
        data = _read(dfd, name, trace_dir + "/" + name, MAX_TRACE)
    finally:
        os.close(dfd)
    if name.endswith(".gz"):
        data = _gunzip(data)
    try:
        doc = json.loads(data.decode("utf-8", "replace"))
    except RecursionError:
        raise ValueError("the trace is nested too deep") from None
    return trace.breakdown(doc, version, speculative), name


def read_dump(recorder_dir, since, ep_size, server_uid=None):
    """(experts.balance of the newest dump written at or after `since` (epoch seconds), the names of
    the dumps written since) or raises OSError / ValueError / safefs.UnsafePath."""
    torch = importlib.import_module("torch")  # the install's: this child runs its interpreter

    dfd, files = _entries(recorder_dir, _owners(server_uid))
    try:
        fresh = sorted((st.st_mtime, n) for n, st in files if DUMP_NAME.match(n) and st.st_mtime >= since - 1)
        if not fresh:
            raise ValueError("the server wrote no expert distribution dump (is it started with "
                             "--expert-distribution-recorder-mode stat?)")
        name = fresh[-1][1]
        path = recorder_dir.rstrip("/") + "/" + name
        fd = safefs.open_regular(dfd, name, path, MAX_DUMP)
        with os.fdopen(fd, "rb") as f:
            obj = torch.load(f, weights_only=True, map_location="cpu")
    finally:
        os.close(dfd)
    if not isinstance(obj, dict) or not hasattr(obj.get("logical_count"), "tolist"):
        raise ValueError("the dump holds no logical_count tensor (a recorder mode other than stat?)")
    count = obj["logical_count"]
    if count.dim() not in (2, 3) or count.numel() > (1 << 24):
        raise ValueError("the dump's logical_count has shape %s" % (tuple(count.shape),))
    return experts.balance(count.tolist(), ep_size), [n for _, n in fresh]


def read(params):
    """The child's answer: params {"trace_dir", "recorder_dir" (None: no dump asked), "since",
    "version", "speculative", "ep_size", "server_uid"}. Returns {"trace", "trace_file",
    "trace_error", "experts", "dump_files" (the dumps written since: run.py removes them),
    "experts_error"}: each figure or why not (never raises for the server's files)."""
    out = {"trace": None, "trace_file": None, "trace_error": None, "experts": None, "dump_files": [],
           "experts_error": None}
    uid = params.get("server_uid")
    try:
        out["trace"], out["trace_file"] = read_trace(params["trace_dir"], params.get("version"),
                                                     bool(params.get("speculative")), uid)
    except (OSError, ValueError, safefs.UnsafePath, EOFError) as e:
        out["trace_error"] = str(e)[:300]
    if params.get("recorder_dir"):
        try:
            out["experts"], out["dump_files"] = read_dump(params["recorder_dir"], float(params.get("since") or 0),
                                                          int(params.get("ep_size") or 1), uid)
        except Exception as e:  # noqa: BLE001 - torch.load's refusals are many kinds; each is a why
            out["experts_error"] = ("%s: %s" % (type(e).__name__, e))[:300]
    return out
