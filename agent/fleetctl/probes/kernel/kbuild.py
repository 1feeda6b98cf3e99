"""Kernel build probe (stdlib only, Python 3.8+): preflight, build and test a kernel package on the host.

main(params) dispatches on params["action"]:
  preflight  facts (nvidia-smi compute_cap, nvcc --version, torch/version.py, triton's version,
             ninja) and a verdict: the backend to build ("triton", "cuda", "cpu" or None), why,
             the arch (TORCH_CUDA_ARCH_LIST value), refusals.
  build      in a child process (own process group), under an flock and a deadline, into an explicit
             build directory: torch.utils.cpp_extension.load (cpu, cuda), or the package's triton
             module's build(arch, out_dir) (the ahead-of-time compile: no GPU, no nvcc); the log is
             kept in BUILD_DIR/build.log.
  test       the package's test module against the built module in a fresh process.
  state      the package's active build (the `current` link's target), whether a build passed
             and is published, its dispatch table's bytes, whether the install has the route hook.
  mark       record that a build passed its reference test (BUILD_DIR/PASSED holds the module path).
  publish    copy a passed build from the private state dir to PUBLIC/NAME/<key> (root, 0755/0644,
             no links), where an unprivileged server process can read it.
torch and triton are never imported here: builds and tests run in child processes of the host's
interpreter.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time

from .. import safefs, trust
from ..facts import gpus, torchver

# Oldest CUDA (torch.version.cuda and nvcc) that can target each compute capability.
MIN_CUDA_FOR_ARCH = {"7.5": (10, 0), "8.0": (11, 0), "8.6": (11, 1), "8.9": (11, 8), "9.0": (11, 8),
                     "10.0": (12, 8), "12.0": (12, 8)}
# Oldest compute capability the triton backend builds for: tl.dot on bf16 needs sm_80 (Ampere).
TRITON_MIN_ARCH = (8, 0)
LOG_TAIL_BYTES = 4000

_BUILD = r"""
import json, sys
a = json.loads(sys.argv[1])
from torch.utils.cpp_extension import load
m = load(name=a["name"], sources=a["sources"], extra_cflags=a["cflags"], extra_cuda_cflags=a["cuda_cflags"],
         extra_ldflags=a["ldflags"], build_directory=a["build_dir"], verbose=True)
with open(a["result"], "w") as f:
    json.dump({"module_path": m.__file__}, f)
"""

_TRITON_BUILD = r"""
import importlib.util, json, sys
a = json.loads(sys.argv[1])
sys.path.insert(0, a["src_dir"])
spec = importlib.util.spec_from_file_location(a["module_name"], a["module"])
m = importlib.util.module_from_spec(spec)
sys.modules[a["module_name"]] = m
spec.loader.exec_module(m)
manifest = getattr(m, a["build"])(a["arch"], a["out_dir"])
with open(a["result"], "w") as f:
    json.dump({"manifest": manifest}, f, default=str)
"""

# The triton build's importable module, BUILD_DIR/NAME.py (the path PASSED records): the package's
# triton module's load() over the compiled kernels, its attributes those of what load() returned,
# so the reference test (and whatever imports the active build) imports it by path as it imports
# a .so. It finds the kernels and the package's sources relative to its own __file__ (the
# published copy, PUBLIC/NAME/<key>/build/NAME.py, works as the private build does). Without a
# CUDA device it refuses to import, naming that. Filled with str.format.
_TRITON_MODULE = '''"""{name}: the triton build for sm_{sm} (written by fleetctl's kbuild probe): {module}'s
{load}() over the kernels compiled into {out_rel}/ beside this file; importing it compiles nothing."""

import importlib.util
import os
import sys

import torch

if not torch.cuda.is_available():
    raise RuntimeError("no CUDA device for the reference test of the triton build (torch %s: "
                       "torch.cuda.is_available() is False); its kernels run on the device only" % torch.__version__)
_here = os.path.dirname(os.path.abspath(__file__))
_src = os.path.normpath(os.path.join(_here, {src_rel!r}))
sys.path.insert(0, _src)  # for the package's own imports of its siblings, while it loads only
try:
    _spec = importlib.util.spec_from_file_location({module_name!r}, os.path.join(_src, {module_rel!r}))
    _source = importlib.util.module_from_spec(_spec)
    sys.modules[{module_name!r}] = _source
    _spec.loader.exec_module(_source)
    _kernels = _source.{load}(os.path.join(_here, {out_rel!r}))
finally:
    sys.path.remove(_src)  # never left to shadow the importing process's top-level modules


def __getattr__(attr):
    return getattr(_kernels, attr)
'''


# what a build's or a test's child imports as root (torch.utils.cpp_extension, the reference test;
# the triton build): the install's own packages
IMPORTS = ("torch", "triton")


def main(params: dict) -> dict:
    """Run params["action"] ("preflight", "build", "test", "state", "mark" or "publish") with the other
    params; see each function. The probe starts with `python -S` (probes.command); torch is
    the install's, so the site module's files are checked (trust.untrusted: the builds run
    this interpreter with its site, as root) before site.main() puts site-packages on sys.path,
    and before a build or test what its child imports (IMPORTS: trust.untrusted_imports, the
    import path and each package's tree). Raises RuntimeError naming the file when they must
    not be run."""
    why = trust.untrusted(sys.executable)
    if why:
        raise RuntimeError("interpreter %s refused: %s (fleetctl runs it as root)" % (sys.executable, why))
    import site
    site.main()
    if params["action"] in ("build", "test"):  # their children import the install's torch (and triton), as root
        why = trust.untrusted_imports(IMPORTS)
        if why:
            raise RuntimeError("not building or testing: root would import code another user may change: %s" % why)
    actions = {"preflight": preflight, "build": build, "test": test, "state": state, "mark": mark,
               "publish": publish}
    return actions[params["action"]](params)


def state(params: dict) -> dict:
    """params: {link: the package's `current` symlink, build_dir: a build's private directory;
    optional: public_dir (the build's published directory PUBLIC/NAME/<key>), table (the
    package's PUBLIC/NAME/dispatch.json), hook (the install's
    sglang/srt/layers/attention/fleetctl_verify.py, or None)}.
    Returns {"current": the link's target or None, "passed": whether build_dir/PASSED exists},
    and for each optional param given: "published" (public_dir/PASSED is a regular file),
    "table" (None when absent; {"sha256", "text"} of the file read without following a link,
    at most TABLE_MAX_BYTES; {"error": why} when it is a link, not a regular file, too big or
    not UTF-8), "hooked" (the hook module is a file there)."""
    try:
        current = os.readlink(params["link"])
    except OSError:
        current = None
    out = {"current": current or None, "passed": os.path.isfile(os.path.join(params["build_dir"], "PASSED"))}
    if params.get("public_dir"):
        try:
            out["published"] = stat.S_ISREG(os.lstat(os.path.join(params["public_dir"], "PASSED")).st_mode)
        except OSError:
            out["published"] = False
    if "table" in params:
        out["table"] = _read_table(params["table"])
    if "hook" in params:
        out["hooked"] = bool(params["hook"]) and os.path.isfile(params["hook"])
    return out


TABLE_MAX_BYTES = 64 << 10


def _read_table(path: str):
    """The dispatch table file at `path` for state(): None, {"sha256", "text"} or {"error"}
    (read from / without following a link: safefs.read_file)."""
    try:
        data = safefs.read_file(path, TABLE_MAX_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, safefs.UnsafePath) as e:
        return {"error": str(e)}
    try:
        return {"sha256": hashlib.sha256(data).hexdigest(), "text": data.decode("utf-8")}
    except UnicodeDecodeError:
        return {"error": "%s: not UTF-8" % path}


def mark(params: dict) -> dict:
    """params: {build_dir, module_path}. Write build_dir/PASSED (the module path) atomically.
    Returns {"ok": true}."""
    path = os.path.join(params["build_dir"], "PASSED")
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "w") as f:
        f.write(params["module_path"] + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"ok": True}


_DIR = safefs.OPEN_DIR
EVIDENCE = "route-evidence"  # PUBLIC/route-evidence: the hook's routing evidence, one dir per server euid


class _Refused(Exception):
    """publish() will not publish (a link in the build, a foreign directory, ...): the message says why."""


def publish(params: dict) -> dict:
    """Publish a build that passed its reference test where the server process can read it.

    params: {build_dir: the private build STATE/kernels/NAME/<key> (src/, build/, PASSED),
    public_dir: PUBLIC/NAME/<key>}. PUBLIC (public_dir's grandparent) and PUBLIC/NAME are made
    root 0755 when missing and must be root's and writable by nobody else; every path is
    reached from / without following a link. When public_dir/PASSED exists the copy is reused
    (published copies are never changed), after checking that everything in it is root's, not
    group/other-writable and no link. Else src/ and build/ are copied into
    PUBLIC/NAME/.<key>.<random> (files root:root 0644, 0755 where the owner may execute; dirs
    0755; a symbolic link, FIFO, socket or device anywhere refuses the publish), PASSED written
    there naming the module at its published path (the private PASSED's path with build_dir
    replaced by public_dir), everything fsynced, then renamed to public_dir. Stale .<key>.*
    directories of a killed publish are removed first. Also makes PUBLIC/route-evidence (root,
    01777; an existing one that is not a root-owned directory refuses) and in it
    route-evidence/<uid> for root and the effective uid of each of params["server_pids"] (the
    servers': _evidence_dirs). Owner root:root when run as root (as on the hosts), else the
    running user's.
    Returns {"ok": true, "published": public_dir, "module_path": the published module,
    "reused": bool, "evidence_dir"} or {"ok": false, "error": why} (nothing published)."""
    bdir = os.path.normpath(os.path.abspath(params["build_dir"]))
    pdir = os.path.normpath(params["public_dir"])
    pkg_dir, key = os.path.split(pdir)
    public, name = os.path.split(pkg_dir)
    if not os.path.isabs(pdir) or key.startswith(".") or not key or not name:
        return {"ok": False, "error": "public_dir %r is not an absolute PUBLIC/NAME/KEY" % params["public_dir"]}
    try:
        top = _open_path(os.path.dirname(public))
        try:
            pub = _subdir(top, os.path.basename(public), 0o755, public)
        finally:
            os.close(top)
        try:
            ev = _subdir(pub, EVIDENCE, 0o1777, os.path.join(public, EVIDENCE), shared=True)
            try:
                _evidence_dirs(ev, _evidence_uids(params.get("server_pids")), os.path.join(public, EVIDENCE))
            finally:
                os.close(ev)
            nfd = _subdir(pub, name, 0o755, pkg_dir)
        finally:
            os.close(pub)
        try:
            reused, module = _publish_into(nfd, bdir, pdir, key)
        finally:
            os.close(nfd)
    except (_Refused, OSError, UnicodeDecodeError) as e:
        return {"ok": False, "error": "not published: %s" % e}
    return {"ok": True, "published": pdir, "module_path": module, "reused": reused,
            "evidence_dir": os.path.join(public, EVIDENCE)}


def _evidence_uids(pids) -> list:
    """0 and the effective uid (/proc/PID/status `Uid:`, its second number: the one the hook writes
    under) of each of `pids` (the servers') still running."""
    uids = {0}
    for pid in pids or []:
        if type(pid) is not int or pid < 1:
            continue
        try:
            with open("/proc/%d/status" % pid) as f:
                line = next((x for x in f.read(16384).splitlines() if x.startswith("Uid:")), "")
            uids.add(int(line.split()[2]))
        except (OSError, IndexError, ValueError):
            continue
    return sorted(uids)


EVIDENCE_TRIES = 3  # route-evidence/<uid> made again at most this often when someone else keeps making it


def _evidence_dirs(ev: int, uids: list, path: str) -> None:
    """route-evidence/<uid> (in open directory `ev`, its path `path`) for each of `uids`: a
    directory of that uid, mode 0755. One that is not (a link, a file, another owner's, writable
    by others: anyone may make an entry in the 01777 route-evidence first, and the hook and the
    route check refuse such a directory) is removed with all in it and made again, so no local
    user can keep a server's evidence from being written. Raises _Refused when another user makes
    it again each time, OSError."""
    for uid in uids:
        name = str(uid)
        for _ in range(EVIDENCE_TRIES):
            st = safefs.lstat(ev, name)
            if st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022:
                break
            if st is not None:
                safefs.rmtree(ev, name)
            try:
                os.mkdir(name, 0o700, dir_fd=ev)
            except FileExistsError:
                continue  # made by someone else meanwhile: judged again
            fd = os.open(name, _DIR, dir_fd=ev)
            try:
                if os.geteuid() == 0:
                    os.fchown(fd, uid, -1)
                os.fchmod(fd, 0o755)
            finally:
                os.close(fd)
            break
        else:
            raise _Refused("%s/%s is made by another user again each time" % (path, name))


def _published_module(nfd: int, key: str, pdir: str) -> str:
    """The module path the published copy `key` (in `nfd`) records in PASSED, after
    _check_published; _Refused when it is not a path inside the copy."""
    _check_published(nfd, key, pdir)
    fd = os.open(key, _DIR, dir_fd=nfd)
    try:
        pfd = os.open("PASSED", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)
    try:
        module = os.read(pfd, 1 << 16).decode("utf-8").strip()
    finally:
        os.close(pfd)
    if not module.startswith(pdir + "/"):
        raise _Refused("%s/PASSED names %s, not a module inside it" % (pdir, module))
    return module


def _publish_into(nfd: int, bdir: str, pdir: str, key: str) -> tuple:
    """publish()'s copy into the package dir (open descriptor `nfd`): (reused, published module path)."""
    for entry in os.listdir(nfd):
        if entry.startswith("." + key + "."):
            safefs.rmtree(nfd, entry)
    if safefs.lstat(nfd, key) is not None:
        if _lstat_in(nfd, key, "PASSED") is not None:
            return True, _published_module(nfd, key, pdir)
        safefs.rmtree(nfd, key)  # never published (no PASSED): a leftover nobody trusted
    with open(os.path.join(bdir, "PASSED")) as f:
        private_module = f.read().strip()
    if not private_module.startswith(bdir + "/"):
        raise _Refused("%s/PASSED names %s, not a module inside the build" % (bdir, private_module))
    module = pdir + private_module[len(bdir):]
    tmp = ".%s.%s" % (key, os.urandom(8).hex())
    os.mkdir(tmp, 0o700, dir_fd=nfd)
    try:
        tfd = os.open(tmp, _DIR, dir_fd=nfd)
        try:
            sfd = os.open(bdir, _DIR)
            try:
                for part in ("src", "build"):
                    os.mkdir(part, 0o700, dir_fd=tfd)
                    s, d = os.open(part, _DIR, dir_fd=sfd), os.open(part, _DIR, dir_fd=tfd)
                    try:
                        _copy_tree(s, d, os.path.join(bdir, part))
                        _own(d, 0o755)
                    finally:
                        os.close(s)
                        os.close(d)
            finally:
                os.close(sfd)
            fd = os.open("PASSED", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=tfd)
            try:
                os.write(fd, (module + "\n").encode("utf-8"))
                _own(fd, 0o644)
            finally:
                os.close(fd)
            _own(tfd, 0o755)
        finally:
            os.close(tfd)
        try:
            os.rename(tmp, key, src_dir_fd=nfd, dst_dir_fd=nfd)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or _lstat_in(nfd, key, "PASSED") is None:
                raise
            safefs.rmtree(nfd, tmp)  # published meanwhile: theirs is reused
            return True, _published_module(nfd, key, pdir)
        os.fsync(nfd)
    except BaseException:
        if safefs.lstat(nfd, tmp) is not None:
            safefs.rmtree(nfd, tmp)
        raise
    return False, module


def _own(fd: int, mode: int) -> None:
    """Give open file or directory `fd` to root:root (when running as root) with `mode`, fsynced."""
    if os.geteuid() == 0:
        os.fchown(fd, 0, 0)
    os.fchmod(fd, mode)  # after fchown, which may clear set-id bits
    os.fsync(fd)


def _copy_tree(sfd: int, dfd: int, where: str) -> None:
    """Copy directory `sfd`'s entries into the empty directory `dfd` (publish()'s modes and owner);
    `where`: the source's path, for messages. Raises _Refused for anything but a regular file or a
    directory (a symbolic link above all)."""
    for entry in sorted(os.listdir(sfd)):
        path = os.path.join(where, entry)
        st = os.stat(entry, dir_fd=sfd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            raise _Refused("%s is a symbolic link: a published build holds none" % path)
        if stat.S_ISDIR(st.st_mode):
            os.mkdir(entry, 0o700, dir_fd=dfd)
            s, d = os.open(entry, _DIR, dir_fd=sfd), os.open(entry, _DIR, dir_fd=dfd)
            try:
                _copy_tree(s, d, path)
                _own(d, 0o755)
            finally:
                os.close(s)
                os.close(d)
        elif stat.S_ISREG(st.st_mode):
            s = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=sfd)
            try:
                if (os.fstat(s).st_ino, os.fstat(s).st_dev) != (st.st_ino, st.st_dev):
                    raise _Refused("%s changed while being copied" % path)
                d = os.open(entry, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                            dir_fd=dfd)
                try:
                    while True:
                        chunk = os.read(s, 1 << 20)
                        if not chunk:
                            break
                        view = memoryview(chunk)
                        while view:
                            view = view[os.write(d, view):]
                    _own(d, 0o755 if st.st_mode & stat.S_IXUSR else 0o644)
                finally:
                    os.close(d)
            finally:
                os.close(s)
        else:
            raise _Refused("%s is not a regular file or directory (mode %o): not published" % (path, st.st_mode))
    os.fsync(dfd)


def _check_published(nfd: int, key: str, pdir: str) -> None:
    """Raise _Refused unless the published copy `key` in `nfd` and everything in it is a
    directory or regular file of root's (this euid's) that no group or other may write."""
    def walk(dfd, where):
        for entry in os.listdir(dfd):
            st = os.stat(entry, dir_fd=dfd, follow_symlinks=False)
            _trusted(st, os.path.join(where, entry))
            if stat.S_ISDIR(st.st_mode):
                sub = os.open(entry, _DIR, dir_fd=dfd)
                try:
                    walk(sub, os.path.join(where, entry))
                finally:
                    os.close(sub)
    _trusted(os.stat(key, dir_fd=nfd, follow_symlinks=False), pdir)
    fd = os.open(key, _DIR, dir_fd=nfd)
    try:
        walk(fd, pdir)
    finally:
        os.close(fd)


def _trusted(st, path: str) -> None:
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        kind = "symbolic link" if stat.S_ISLNK(st.st_mode) else "special file"
        raise _Refused("%s in the published build is a %s" % (path, kind))
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise _Refused("%s in the published build is owned by uid %d or writable by others (mode %o): "
                       "not reusing it" % (path, st.st_uid, stat.S_IMODE(st.st_mode)))


def _open_path(path: str) -> int:
    """A descriptor of existing directory `path` (absolute), reached from / one component at a
    time without following a link (safefs.open_dir; _Refused names the component that is one)."""
    try:
        return safefs.open_dir(path)
    except safefs.UnsafePath as e:
        raise _Refused(str(e))


def _subdir(dfd: int, name: str, mode: int, path: str, shared: bool = False) -> int:
    """A descriptor of directory `name` in `dfd` (its path `path`), made root's with `mode` when
    missing. An existing one must be a directory (never a link) of root's (this euid's); unless
    `shared` (route-evidence: 01777 by design, its mode set) no group or other may write it."""
    try:
        os.mkdir(name, mode, dir_fd=dfd)
        fd = os.open(name, _DIR, dir_fd=dfd)
        _own(fd, mode)
        os.fsync(dfd)
        return fd
    except FileExistsError:
        pass
    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        raise _Refused("%s is not a directory (%s)" % (path, "a symbolic link" if stat.S_ISLNK(st.st_mode)
                                                       else "mode %o" % st.st_mode))
    if st.st_uid != os.geteuid():
        raise _Refused("%s is owned by uid %d, not root: not publishing there" % (path, st.st_uid))
    if not shared and st.st_mode & 0o022:
        raise _Refused("%s is writable by group or others (mode %o): not publishing there"
                       % (path, stat.S_IMODE(st.st_mode)))
    fd = os.open(name, _DIR, dir_fd=dfd)
    if shared and stat.S_IMODE(st.st_mode) != mode:
        os.fchmod(fd, mode)
    return fd


def _lstat_in(dfd: int, name: str, inner: str):
    """lstat of `inner` in directory `name` of `dfd` (None when either is missing or `name` is no directory)."""
    try:
        fd = os.open(name, _DIR, dir_fd=dfd)
    except OSError:
        return None
    try:
        return safefs.lstat(fd, inner)
    finally:
        os.close(fd)


def preflight(params: dict) -> dict:
    """Facts and verdict for params["backends"] (the package's backends, e.g. ["cpu", "cuda",
    "triton"]) and params.get("backend") (the operator's --backend; None: chosen from the host).

    Returns {"facts": gather_facts(), "backend": str|None, "choice": str, "why": str,
    "arch": str|None, "refusals": [str]} (see decide).
    """
    facts = gather_facts()
    return dict(facts=facts, **decide(facts, params["backends"], params.get("backend")))


def gather_facts() -> dict:
    """Build-relevant facts of this host and interpreter, read without importing torch or triton.

    gpus: [{"name", "compute_cap"}] of the GPUs that answer nvidia-smi (gpus.ARGS, read by
    gpus.parse; [] without nvidia-smi); gpu_errors: gpus.parse's [{index, pci_bus_id, error}]
    of lost GPUs; gpu_error: gpus.parse's reason (lost GPUs, nvidia-smi failed) or None; nvcc:
    {"path", "version"} or None, found as torch finds it (CUDA_HOME/CUDA_PATH, PATH,
    /usr/local/cuda); torch: {"version", "cuda", "path"} from torch/version.py
    (torchver.importable) or None; triton: {"version", "path"} (_triton) or None; ninja: its
    path (PATH plus the interpreter's bin dir) or None.
    """
    python = sys.executable
    facts = {"python": python, "gpus": [], "gpu_errors": [], "gpu_error": None, "cpu_count": os.cpu_count()}
    smi = shutil.which("nvidia-smi")
    if smi:
        r = _run([smi] + gpus.ARGS)
        rows, facts["gpu_errors"], facts["gpu_error"] = gpus.parse(r.stdout, r.stderr, r.returncode)
        facts["gpus"] = [{"name": g["name"], "compute_cap": g["compute_cap"]} for g in rows]
    facts["nvcc"] = _nvcc()
    facts["torch"] = torchver.importable()
    facts["triton"] = _triton()
    facts["ninja"] = shutil.which("ninja", path=_search_path(python))
    return facts


def decide(facts: dict, backends: list, forced: str | None = None) -> dict:
    """Which backend to build, for which arch, why, or why not:
    {"backend", "choice", "why", "arch", "refusals"}.

    choice: `forced` (the operator's --backend), else from the host: no GPU, cpu; a GPU host,
    triton when the package has a triton backend, triton is importable by this interpreter (the
    one SGLang runs; SGLang's wheels depend on triton), torch is a CUDA build and the GPUs are
    of one arch >= TRITON_MIN_ARCH; else cuda. why: one sentence, how choice was made. backend:
    choice, or None when there are refusals. arch: the GPUs' compute capabilities
    ("9.0", "9.0;12.0"), None for cpu.
    Refusals: torch missing, the GPUs unreadable, the package lacking the choice's backend; cpu
    and cuda: ninja missing (torch.utils.cpp_extension); cuda: _cuda_refusals; triton:
    _triton_refusals.
    """
    torch, cards = facts.get("torch"), facts.get("gpus") or []
    archs = sorted({g["compute_cap"] or "unknown" for g in cards}, key=_version)
    sms = ", ".join(_sm(a) for a in archs)
    refusals = []
    if not torch:
        refusals.append("torch is not installed for %s" % facts.get("python"))
    if facts.get("gpu_error"):
        refusals.append("cannot read the GPUs: %s" % facts["gpu_error"])
    if forced:
        choice, why = forced, "--backend %s (the operator's choice)" % forced
    elif not cards:
        choice, why = "cpu", "no GPU answers nvidia-smi"
    else:
        not_triton = _triton_refusals(facts, archs) if "triton" in backends else ["the package has no triton backend"]
        choice = "cuda" if not_triton else "triton"
        why = ("%s GPU and triton %s importable by %s" % (sms, facts["triton"]["version"], facts.get("python"))
               if choice == "triton" else "%s GPU, not triton: %s" % (sms, "; ".join(not_triton)))
    if choice not in backends:
        refusals.append("the package has no %s backend (it has %s)" % (choice, ", ".join(sorted(backends))) if forced
                        else "no GPU and the package has no cpu backend" if choice == "cpu"
                        else "GPU host (%s) but the package has no cuda backend" % sms)
    if choice in ("cpu", "cuda") and not facts.get("ninja"):
        refusals.append("ninja is not on PATH (torch.utils.cpp_extension needs it)")
    if choice == "cuda":
        refusals += _cuda_refusals(facts, archs)
    elif choice == "triton":
        refusals += _triton_refusals(facts, archs)
    arch = ";".join(archs) if archs and choice != "cpu" else None
    return {"backend": None if refusals else choice, "choice": choice, "why": why, "arch": arch, "refusals": refusals}


def _cuda_refusals(facts: dict, archs: list) -> list:
    """Why the cuda backend cannot be built for GPUs of `archs`: none (no GPU), nvcc missing,
    nvcc's major version differs from torch.version.cuda's, torch is a CPU build, or torch/nvcc
    are older than an arch needs (MIN_CUDA_FOR_ARCH, e.g. sm_120 needs CUDA >= 12.8)."""
    torch, nvcc = facts.get("torch"), facts.get("nvcc")
    if not archs:
        return ["no GPU answers nvidia-smi: the cuda backend builds for the host's GPU arch"]
    refusals = []
    tcuda = torch and torch.get("cuda")
    if not nvcc or not nvcc["version"]:
        refusals.append("nvcc not found or its version unreadable (CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda/bin)")
        nvcc = None
    if torch and not tcuda:
        refusals.append("torch %s is a CPU build (torch.version.cuda is None) on a GPU host" % torch["version"])
    if nvcc and tcuda and _version(nvcc["version"])[0] != _version(tcuda)[0]:
        refusals.append("nvcc %s major differs from torch's CUDA %s" % (nvcc["version"], tcuda))
    for arch in archs:
        need = MIN_CUDA_FOR_ARCH.get(arch)
        if need is None:
            refusals.append("%s is not a supported arch (%s)" % (_sm(arch), ", ".join(sorted(MIN_CUDA_FOR_ARCH))))
            continue
        for who, have in (("torch", tcuda), ("nvcc", nvcc and nvcc["version"])):
            if have and _version(have) < need:
                refusals.append("%s needs CUDA >= %d.%d; %s has CUDA %s" % (_sm(arch), need[0], need[1], who, have))
    return refusals


def _triton_refusals(facts: dict, archs: list) -> list:
    """Why the triton backend cannot be built and tested for GPUs of `archs`: no GPU (no arch to
    compile for, no device for the reference test), GPUs of more than one arch (a build targets
    one), an arch older than TRITON_MIN_ARCH or unknown, triton not importable by this
    interpreter or its version unreadable, torch a CPU build (the reference test runs on the
    device through torch)."""
    torch, triton = facts.get("torch"), facts.get("triton")
    refusals = []
    if not archs:
        refusals.append("no GPU answers nvidia-smi: the triton backend compiles for the host's GPU arch "
                        "and its reference test runs on the device")
    elif len(archs) > 1:
        refusals.append("GPUs of %d archs (%s): a triton build targets one" % (len(archs), ", ".join(map(_sm, archs))))
    for arch in archs:
        if len(_version(arch)) < 2 or _version(arch) < TRITON_MIN_ARCH:
            refusals.append("%s is older than the triton backend's sm_%d%d or unknown"
                            % ((_sm(arch),) + TRITON_MIN_ARCH))
    if not triton:
        refusals.append("triton is not importable by %s" % facts.get("python"))
    elif not triton.get("version"):
        refusals.append("triton's version is unreadable from %s" % triton["path"])
    if torch and not torch.get("cuda"):
        refusals.append("torch %s is a CPU build (torch.version.cuda is None): no device for the triton "
                        "backend's reference test" % torch["version"])
    return refusals


def build(params: dict) -> dict:
    """Build an extension with torch.utils.cpp_extension.load, or a triton build, in a child process.

    params: src_dir (uploaded package), build_dir (staging), name (module name), sources (relative
    to src_dir), cflags, cuda_cflags, ldflags, arch (TORCH_CUDA_ARCH_LIST, None for cpu), max_jobs
    (cap on MAX_JOBS, default 4), deadline_s (default 1800 s, waiting for the lock included),
    lock_path (default BUILD_DIR.lock). kind "triton" (kernelpkg.TritonBackend's parameters):
    module (.py relative to src_dir), build, load (its function names) in place of sources and
    flags; the child calls module.build(arch as an int: "9.0" -> 90, BUILD_DIR/kernels), then
    BUILD_DIR/NAME.py is written (_TRITON_MODULE) and is the module_path; "manifest" is what
    build returned.
    An flock on lock_path serialises builds; under it torch's own `lock` file in build_dir, which a
    killed build leaves behind (torch then waits forever), is removed. The child's environment:
    MAX_JOBS, PATH (_search_path), and CCACHE_BASEDIR (_cache_base) unless already set. At the
    deadline the child's whole process group is killed. Returns {"ok", "module_path", "log_path",
    "log_tail" (failure only), "rc", "timed_out", "seconds", "removed_stale_lock", "pgid"}.
    """
    start = time.monotonic()
    deadline = start + float(params.get("deadline_s", 1800))
    python = sys.executable
    build_dir = os.path.abspath(params["build_dir"])
    os.makedirs(build_dir, exist_ok=True)
    log_path = os.path.join(build_dir, "build.log")
    result_path = os.path.join(build_dir, "build-result.json")
    out = {"ok": False, "module_path": None, "log_path": log_path, "log_tail": None, "rc": None,
           "timed_out": False, "seconds": 0.0, "removed_stale_lock": False, "pgid": None}
    lock_path = params.get("lock_path") or build_dir + ".lock"
    lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not _flock(lock_fd, deadline):
            out.update(timed_out=True, log_tail="another build held %s until the deadline" % lock_path)
            return out
        torch_lock = os.path.join(build_dir, "lock")
        if os.path.lexists(torch_lock):
            os.unlink(torch_lock)
            out["removed_stale_lock"] = True
        if os.path.exists(result_path):
            os.unlink(result_path)
        jobs = max(1, min(int(params.get("max_jobs", 4)), os.cpu_count() or 1))
        env = dict(os.environ, MAX_JOBS=str(jobs), PATH=_search_path(python))
        base = _cache_base(params["src_dir"], build_dir)
        if base and "CCACHE_BASEDIR" not in env:
            env["CCACHE_BASEDIR"] = base
        env.pop("TORCH_CUDA_ARCH_LIST", None)
        if params.get("arch"):
            env["TORCH_CUDA_ARCH_LIST"] = params["arch"]
        src_dir = os.path.abspath(params["src_dir"])
        if params.get("kind") == "triton":
            script, args = _TRITON_BUILD, _triton_args(params, src_dir, build_dir, result_path)
        else:
            script = _BUILD
            args = {"name": params["name"], "build_dir": build_dir, "result": result_path,
                    "sources": [os.path.join(src_dir, s) for s in params["sources"]],
                    "cflags": params.get("cflags") or [], "cuda_cflags": params.get("cuda_cflags") or [],
                    "ldflags": params.get("ldflags") or []}
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([python, "-c", script, json.dumps(args)], stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, cwd=build_dir, env=env,
                                    start_new_session=True, pass_fds=(lock_fd,))
            out["pgid"] = proc.pid
            out["rc"], out["timed_out"] = _wait(proc, deadline)
        if out["rc"] == 0 and os.path.exists(result_path):
            with open(result_path) as f:
                done = json.load(f)
            if params.get("kind") == "triton":
                out["manifest"], done["module_path"] = done["manifest"], _write_triton_module(params, args)
            out["module_path"], out["ok"] = done["module_path"], True
        else:
            out["log_tail"] = _tail(log_path)
        return out
    finally:
        os.close(lock_fd)
        out["seconds"] = round(time.monotonic() - start, 3)


def _triton_args(params: dict, src_dir: str, build_dir: str, result_path: str) -> dict:
    """The triton build child's arguments (_TRITON_BUILD); the module is imported under its file
    name (triton_verify.py -> triton_verify), sys.path starting at the package."""
    module = os.path.join(src_dir, params["module"])
    return {"src_dir": src_dir, "module": module, "module_name": os.path.basename(module)[:-3],
            "build": params["build"], "load": params["load"], "arch": int(params["arch"].replace(".", "")),
            "out_dir": os.path.join(build_dir, "kernels"), "result": result_path}


def _write_triton_module(params: dict, args: dict) -> str:
    """Write BUILD_DIR/NAME.py (_TRITON_MODULE) for a finished triton build atomically; its path.
    BUILD_DIR is the directory above the kernels (args["out_dir"]); the module names the kernels,
    the sources (args["src_dir"]) and the package's module (args["module"]) relative to it."""
    here = os.path.dirname(args["out_dir"])
    path = os.path.join(here, params["name"] + ".py")
    text = _TRITON_MODULE.format(name=params["name"], sm=args["arch"], module=params["module"], load=args["load"],
                                 out_rel=os.path.relpath(args["out_dir"], here),
                                 src_rel=os.path.relpath(args["src_dir"], here), module_name=args["module_name"],
                                 module_rel=os.path.relpath(args["module"], args["src_dir"]))
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def test(params: dict) -> dict:
    """Run the package's test module on a built module in a fresh process.

    params: src_dir, module_path, test (relative to src_dir), reference ("file.py:func"),
    tolerances ({dtype: [atol, rtol]}), device ("cpu"/"cuda"), deadline_s (default 600 s).
    The test prints one JSON line and exits 0 when it passes. Returns {"ok", "rc", "timed_out",
    "result" (the test's JSON or None), "stderr_tail", "seconds"}.
    """
    start = time.monotonic()
    python = sys.executable
    src_dir = os.path.abspath(params["src_dir"])
    cmd = [python, os.path.join(src_dir, params["test"]), "--module", params["module_path"],
           "--device", params["device"], "--reference", params["reference"],
           "--tolerances", json.dumps(params["tolerances"])]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=src_dir, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=float(params.get("deadline_s", 600)))
        timed_out = False
    except subprocess.TimeoutExpired:
        _killpg(proc.pid)
        stdout, stderr = proc.communicate()
        timed_out = True
    lines = stdout.decode("utf-8", "replace").strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except ValueError:
        result = None
    ok = proc.returncode == 0 and isinstance(result, dict) and result.get("ok") is True
    return {"ok": ok, "rc": proc.returncode, "timed_out": timed_out, "result": result,
            "stderr_tail": stderr.decode("utf-8", "replace")[-LOG_TAIL_BYTES:],
            "seconds": round(time.monotonic() - start, 3)}


def _flock(fd: int, deadline: float) -> bool:
    """Take an exclusive flock on fd, polling until the monotonic deadline; False if not taken."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def _wait(proc: subprocess.Popen, deadline: float):
    """Wait for proc until the deadline, then kill its process group: (returncode, timed_out)."""
    try:
        return proc.wait(timeout=max(0.0, deadline - time.monotonic())), False
    except subprocess.TimeoutExpired:
        _killpg(proc.pid)
        return proc.wait(), True


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _tail(path: str) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - LOG_TAIL_BYTES))
        return f.read().decode("utf-8", "replace")


def _run(cmd: list) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return subprocess.CompletedProcess(cmd, 127, "", str(e))


def _root_only(d: str) -> bool:
    """Whether directory `d` and every directory above it are owned by root (or this user) and
    writable by nobody else; above `d`, a sticky root-owned directory such as /tmp is fine (no
    other user can rename what root made in it), `d` itself never is."""
    if not os.path.isabs(d):
        return False
    d, leaf = os.path.realpath(d), True
    while True:
        try:
            st = os.stat(d)
        except OSError:
            return False
        shared = st.st_mode & 0o022 and (leaf or not st.st_mode & stat.S_ISVTX)
        if not os.path.isdir(d) or st.st_uid not in (0, os.geteuid()) or shared:
            return False
        if d == "/":
            return True
        d, leaf = os.path.dirname(d), False


def _cache_base(src_dir: str, build_dir: str) -> str | None:
    """The directory above both the sources and the build (a build key's directory), or None when
    only / is. torch.utils.cpp_extension puts ccache (or sccache) before the compiler when it is
    on PATH (its _wrap_compiler); with CCACHE_BASEDIR there, ccache hashes the sources' paths
    relative to the build directory (ccache(1), base_dir), so the same sources under another build
    key compile once: without it every new key's absolute paths miss the cache."""
    common = os.path.commonpath([os.path.abspath(src_dir), build_dir])
    return None if common == os.sep else common


def _search_path(python: str) -> str:
    """The PATH builds run with: the interpreter's bin directory (where a venv's ninja lives;
    the facts probe's trust check cleared it), then this session's PATH, keeping only the
    directories that no user but root can write (review M6: a planted `c++`, `ninja` or `nvcc`
    in a user-writable directory on root's PATH would run as root). Relative and empty entries
    (the working directory) are dropped too."""
    dirs = [os.path.dirname(os.path.abspath(python))] + os.environ.get("PATH", os.defpath).split(os.pathsep)
    kept = []
    for d in dirs:
        if d not in kept and _root_only(d):
            kept.append(d)
    return os.pathsep.join(kept)


def _nvcc():
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [os.path.join(home, "bin", "nvcc")] if home else []
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            m = re.search(r"release (\d+\.\d+)", _run([path, "--version"]).stdout)
            return {"path": path, "version": m.group(1) if m else None}
    return None


def _triton():
    """The triton `import triton` gives: {"version": triton.__version__, "path": its
    __init__.py}, read from that file's top-level constants (triton is not imported: that loads
    its drivers), or None when it is not importable."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.origin:
        return None
    return {"version": torchver.fields(spec.origin).get("__version__"), "path": spec.origin}


def _sm(arch: str) -> str:
    return "sm_" + arch.replace(".", "")


def _version(text: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:2])
