"""Drift of an installed distribution from its RECORD: which files differ from the sha256 the
wheel installed them with, hashed through a cache kept by file identity (for `status`).

Stdlib only (Python 3.8+), loaded in the change probe's bundle. The cache is a scancache.Store
in STATE_DIR/scan-cache (`record-<sha256>.json`), keyed CACHE_KEY; files are read with
safefs.sha256_file (never through a link, never a FIFO or device).
"""

import os
import stat
import time

from . import distinfo, scancache
from .. import safefs

# The RECORD hash cache: entries of files changed this recently are not kept (their ctime cannot
# yet tell a later rewrite; as callsites.RACY_S); its cache key names the format.
RACY_S = 2.0
CACHE_KEY = "record-sha256-1"


def hashes(paths, state_dir, ident, location):
    """{path: safefs.sha256_file(path)} for real paths `paths`, each file read only when its
    identity (size, mtime_ns, ctime_ns, inode; lstat) is not the one the record cache `ident`
    holds (state_dir/scan-cache, a scancache.Store), which is then refreshed (files changed in
    the last RACY_S seconds left out). A cache that cannot be used costs only the reads."""
    store = scancache.Store(CACHE_KEY, os.path.join(state_dir, "scan-cache"))
    try:
        old, _ = store.load(ident, "record")
        settled = time.time_ns() - int(RACY_S * 1e9)
        out, new = {}, {}
        for path in paths:
            try:
                st = os.lstat(path)
            except OSError:
                st = None
            ident_now = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino] if st and stat.S_ISREG(st.st_mode) else None
            kept = old.get(path)
            if ident_now is not None and isinstance(kept, list) and len(kept) == 5 and kept[:4] == ident_now \
                    and isinstance(kept[4], str):
                out[path] = kept[4]
            else:
                out[path] = safefs.sha256_file(path)
            if ident_now is not None and st.st_ctime_ns < settled and out[path] and not out[path].startswith("<"):
                new[path] = ident_now + [out[path]]
        if new != old:
            try:
                store.save(ident, location, new, "record")
            except OSError:
                pass  # an optimisation: the answer stands
        return out
    finally:
        store.close()


def problems(location, dist_name, explained, state_dir):
    """Files of distribution `dist_name` in `location` whose sha256 differs from its RECORD
    (sha256=<urlsafe b64, no padding>), minus files whose hex sha256 is `explained[realpath]`;
    hashes come through hashes() (cached by file identity in `state_dir`). The RECORD is that of
    the dist-info whose RECORD matches the package's files (distinfo.choose: a stale dist-info an
    interrupted upgrade left is never the one files are judged by). Returns (problems or None,
    error or None, warning naming stale or duplicate dist-infos or None)."""
    want = distinfo.norm(dist_name)
    package = want.replace("-", "_")
    # one hashes() call (one cache entry) for the files of every candidate's RECORD, the key files
    # distinfo.choose matches them on among them: a warm status reads nothing whose identity held
    records = [distinfo.record(d) or {} for d in distinfo.dist_infos(location, dist_name)]
    where = dict((rel, os.path.realpath(os.path.join(location, rel))) for r in records for rel, h in r.items() if h)
    current = hashes(sorted(set(where.values())), state_dir, "%s|%s" % (location, want), location)
    chosen = distinfo.choose(location, dist_name, package, lambda paths: dict((p, current.get(p)) for p in paths))
    if chosen["path"] is None:
        return None, chosen["warning"] or "no %s distribution in %s" % (dist_name, location), chosen["warning"]
    out = []
    hashed = [(value, where[rel]) for rel, value in (distinfo.record(chosen["path"]) or {}).items() if value]
    for value, path in hashed:
        cur = current[path]
        if cur is None:
            out.append({"path": path, "problem": "missing"})
            continue
        if cur.startswith("<"):  # a FIFO, device, socket or link: never read
            out.append({"path": path, "problem": "skipped, not read: " + cur[1:-1]})
            continue
        if distinfo.b64(cur) != value and explained.get(path) != cur:
            out.append({"path": path, "problem": "modified outside fleetctl"})
    return out, None, chosen["warning"]
