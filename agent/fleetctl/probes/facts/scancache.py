"""Remote probe helper: the scan cache, one file per install, kept on the host (issue 18).

Stdlib only (Python 3.8+). Where: STATE_DIR/scan-cache when the probe runs as root, else the
login user's `$XDG_CACHE_HOME/fleetctl` (default ~/.cache/fleetctl). The directory is reached
from / one component at a time with O_NOFOLLOW (safefs.open_dir: a symlink on the way disables
the cache), made 0700, and must belong to this euid; each cache file is opened with O_NOFOLLOW and must be a
regular file of this euid, at most MAX_FILE_BYTES. Anything else is reported, never followed.

A cache file is `scan-<sha256 of the install id>.json`: a header line {format, install, key,
package_dir} and a line of {rel: entry} (callsites.file_entry); `locate-<sha256>.json` keeps an
interpreter's locate answer with the identities it depends on (facts.located), so that a warm
run starts no second interpreter; `record-<sha256>.json` keeps the sha256 of each file of an
installed distribution's RECORD by file identity (record.hashes, for `status`);
`route-<sha256>.json` keeps an install's verify_attention anchor with the files it was read from
(verifyroute.found_anchor);
`interpreter` names the interpreter the last probe ran under,
so that the next one starts it directly (probes.command); `code-<sha256>.marshal` keeps the
compiled probe modules of one bundle for one interpreter build (CodeCache, read by the probe
wrapper, as Python keeps .pyc files). `key` is the sha256 of the
bundled probe sources (sent by fleetctl): a file written by other probe code is discarded, as is
one that cannot be read or parsed. The directory is bounded (MAX_DIR_BYTES, oldest dropped
first) and loses the files of installs whose package directory is gone.
"""

import hashlib
import json
import marshal
import os
import stat
import sys
import types

from .. import safefs

STATE_DIR = "/var/lib/fleetctl"  # the ledger's state dir (ledger.STATE_DIR)
FORMAT = 1
MAX_FILE_BYTES = 16 << 20
MAX_DIR_BYTES = 64 << 20
# The interpreter a probe ran under, one line (Store.keep_interpreter); probes.command's shell
# reads this name in the same directory.
INTERPRETER = "interpreter"
# The cache's own files (Store.clear; temporary ones start with a dot).
_KINDS = ("scan-", "locate-", "record-", "route-", "code-")  # code- last: the only one not JSON


class CacheRefused(Exception):
    """The cache directory or a cache file is not ours or not safe to use; the message says why."""


def cache_dir():
    """The cache directory's absolute path for this euid (see the module docstring)."""
    if os.geteuid() == 0:
        return os.path.join(STATE_DIR, "scan-cache")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.normpath(base), "fleetctl")


def _open_dir(path, create):
    """A descriptor of directory `path` (absolute, normalised), walked from / without following
    a link (safefs.open_dir); missing components made 0700 when `create` (else None is
    returned). It must belong to this euid and is made 0700. Raises CacheRefused."""
    try:
        fd = safefs.open_dir(path, 0o700 if create else None)
    except FileNotFoundError:
        return None
    except safefs.UnsafePath as e:
        raise CacheRefused(str(e))
    except OSError as e:
        raise CacheRefused("%s: %s" % (path, e.strerror))
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise CacheRefused("%s belongs to uid %d, not %d" % (path, st.st_uid, os.geteuid()))
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _name(what, ident, ext="json"):
    return "%s-%s.%s" % (what, hashlib.sha256(ident.encode("utf-8", "surrogateescape")).hexdigest()[:32], ext)


def _read(dfd, name, limit=MAX_FILE_BYTES):
    """The bytes (at most `limit`) of cache file `name` in `dfd`, None when missing. Raises CacheRefused."""
    try:
        fd = os.open(name, safefs.OPEN_READ, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CacheRefused("%s: %s" % (name, e.strerror))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > MAX_FILE_BYTES:
            raise CacheRefused("%s is not a regular file of uid %d under %d bytes" % (name, os.geteuid(), MAX_FILE_BYTES))
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit)
    finally:
        os.close(fd)


def _header(data):
    try:
        doc = json.loads(data.split(b"\n", 1)[0])
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


class Store(object):
    """The scan caches of this host's installs, for probe sources of sha256 `key`. `error` says
    why the cache is off (the directory is refused), else None."""

    def __init__(self, key, directory=None):
        self.key, self.path, self.error = key, directory or cache_dir(), None
        try:
            self.fd = _open_dir(self.path, create=True)
        except (CacheRefused, OSError) as e:
            self.fd, self.error = None, str(e)

    def file_path(self, install_id):
        """Where install `install_id`'s scan cache lives (absolute path)."""
        return os.path.join(self.path, _name("scan", install_id))

    def load(self, install_id, what="scan"):
        """The {…} cached for `install_id` ({} when missing, unreadable, from other probe
        sources, or the cache is off). Returns (entries, why discarded or None). `what`: "scan"
        (callsites entries), "locate" (an interpreter's locate answer, see facts.located) or
        "record" (RECORD hashes, see record.hashes) or "route" (the verify_attention anchor, see
        verifyroute.found_anchor)."""
        if self.fd is None:
            return {}, None
        try:
            data = _read(self.fd, _name(what, install_id))
        except CacheRefused as e:
            return {}, "discarded: %s" % e
        if data is None:
            return {}, None
        head = _header(data)
        if not head or head.get("format") != FORMAT or head.get("install") != install_id or head.get("key") != self.key:
            return {}, "discarded: written for another install or other probe code"
        try:
            entries = json.loads(data.split(b"\n", 1)[1])
        except (ValueError, IndexError):
            return {}, "discarded: not JSON (cut short?)"
        return (entries, None) if isinstance(entries, dict) else ({}, "discarded: not a mapping")

    def save(self, install_id, package_dir, entries, what="scan"):
        """Write `entries` for `install_id` (O_EXCL temporary file, renamed over the old one); it
        is pruned once `package_dir` is gone. A cache over MAX_FILE_BYTES is not written.
        Raises OSError."""
        if self.fd is None:
            return
        head = {"format": FORMAT, "install": install_id, "key": self.key, "package_dir": package_dir}
        data = (json.dumps(head) + "\n" + json.dumps(entries, separators=(",", ":"))).encode("utf-8", "surrogateescape")
        name = _name(what, install_id)
        if len(data) > MAX_FILE_BYTES:
            self._unlink(name)
            return
        self._write(name, data)

    def keep_interpreter(self, python, why_not):
        """Record `python` (the interpreter running this probe, an absolute path) in INTERPRETER,
        which the next probe's start reads before any Python runs (probes.command): a warm run
        starts it directly, not through a version manager's shim. Written only when it differs,
        and then only when `why_not(python)` (facts.untrusted) has no objection. Raises OSError."""
        if self.fd is None or not os.path.isabs(python):
            return
        data = (python + "\n").encode("utf-8", "surrogateescape")
        try:
            if _read(self.fd, INTERPRETER, 4096) == data:
                return
        except CacheRefused:
            pass
        if b"\n" in data[:-1] or why_not(python):
            self._unlink(INTERPRETER)
            return
        self._write(INTERPRETER, data)

    def _write(self, name, data):
        """Write cache file `name` (O_EXCL temporary file, renamed over the old one)."""
        tmp = ".%s.%d.tmp" % (name, os.getpid())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                     0o600, dir_fd=self.fd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            self._unlink(tmp)
            raise

    def _unlink(self, name):
        try:
            os.unlink(name, dir_fd=self.fd)
        except OSError:
            pass

    def prune(self, keep):
        """Drop the caches of installs whose package directory is gone, then the oldest ones
        (not in `keep`, install ids) until the directory holds at most MAX_DIR_BYTES."""
        if self.fd is None:
            return
        keep_names, sized = set(_name(w, i) for i in keep for w in ("scan", "locate", "route")), []
        for name in os.listdir(self.fd):
            try:
                st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            except OSError:
                continue
            if name.startswith("code-") and name.endswith(".marshal"):
                sized.append((st.st_mtime_ns, st.st_size, name))  # bounded with the rest, oldest first
                continue
            if not (name.startswith(_KINDS[:-1]) and name.endswith(".json")) or name in keep_names:
                continue
            try:
                head = _header(_read(self.fd, name, 4096) or b"")
            except CacheRefused:
                head = None
            if not head or not isinstance(head.get("package_dir"), str) or not os.path.isdir(head["package_dir"]):
                self._unlink(name)
            else:
                sized.append((st.st_mtime_ns, st.st_size, name))
        total = sum(s for _, s, _ in sized)
        for _, size, name in sorted(sized):
            if total <= MAX_DIR_BYTES:
                break
            self._unlink(name)
            total -= size

    def clear(self):
        """Remove every cache file; returns how many."""
        if self.fd is None:
            return 0
        names = [n for n in os.listdir(self.fd) if n.lstrip(".").startswith(_KINDS) or n == INTERPRETER]
        for n in names:
            self._unlink(n)
        return len(names)

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class CodeCache(object):
    """The compiled probe modules of the bundle whose sources have sha256 `key`, kept for this
    interpreter build (sys.version and the bytecode cache tag: code objects are only valid for
    the build that made them) and optimisation level (`-O`/PYTHONOPTIMIZE strip asserts and
    docstrings at compile time, as .pyc files keep `opt-N` apart) in `code-<sha256>.marshal`: a header line {format, key, build} and
    a marshal'd {module name: code object}. Compiling the eight modules of the facts bundle was a
    quarter of a warm probe's CPU on a small install (0.023 of 0.085 s, bench/results/NOTES.md).
    The file follows the Store's rules (this euid's 0700 directory, O_NOFOLLOW, a regular file
    of this euid); marshal data is only as trusted as a .pyc of this user, which is what it is.
    A cache that is off, missing, of another build or damaged gives nothing and costs a compile;
    no method raises."""

    def __init__(self, key, directory=None):
        self.code, self.fresh = {}, False
        build = "%s|%s|O%d" % (sys.version, sys.implementation.cache_tag, sys.flags.optimize)
        self.head = {"format": FORMAT, "key": key, "build": build}
        self.name = _name("code", key + "|" + build, "marshal")
        self.store = Store(key, directory)
        try:
            data = _read(self.store.fd, self.name) if self.store.fd is not None else None
            if data is not None and _header(data) == self.head:
                code = marshal.loads(data.split(b"\n", 1)[1])
                if isinstance(code, dict) and all(isinstance(c, types.CodeType) and
                                                  c.co_filename == "<fleetctl probe %s>" % n for n, c in code.items()):
                    self.code = code
        except (CacheRefused, OSError, ValueError, EOFError, TypeError, IndexError):
            self.code = {}

    def get(self, name):
        """The code object kept for module `name`, or None."""
        return self.code.get(name)

    def add(self, name, code):
        """Keep `code` (compiled from module `name` of this bundle) for the next run."""
        self.code[name], self.fresh = code, True

    def save(self):
        """Write the kept code when something was added, then close the directory."""
        try:
            if self.fresh and self.store.fd is not None:
                self.store._write(self.name, json.dumps(self.head).encode() + b"\n" + marshal.dumps(self.code))
        except (OSError, ValueError):
            pass  # an optimisation: the next run compiles again
        finally:
            self.store.close()


def main(params):
    """Probe entry point for `fleetctl cache clear`: params {"action": "clear"} -> {path, removed, error}."""
    store = Store(None)
    try:
        return {"path": store.path, "removed": store.clear() if params.get("action") == "clear" else 0,
                "error": store.error}
    finally:
        store.close()
