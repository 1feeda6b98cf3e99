"""The kbuild probe's build and test actions (stdlib only, Python 3.8+): each runs its child, the
install's interpreter importing its torch and triton, as an unprivileged uid (runas.account:
the install's server's, else its owner, else nobody or fleetctl_unprivileged_user; never root),
in a private directory of that uid (runas.private_dir) holding a root-made copy of what it needs.
  build  in its own process group, under an flock and a deadline, into WORK/build:
         torch.utils.cpp_extension.load (cpu, cuda), or the package's triton module's
         build(arch, out_dir) (the ahead-of-time compile: no GPU, no nvcc); the log is kept in
         BUILD_DIR.log. What the child made is data: root copies WORK/build into BUILD_DIR
         only after checking it (copy.py: regular files and directories only, no link, bounded;
         root's files, 0644/0755).
  test   the package's test module against a copy of the built module, in a fresh process."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time

from .. import runas, safefs
from . import copy, proc

MAX_RESULT = 1 << 20  # bytes of the child's result file


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


def account(params: dict):
    """The runas.Account a build's or a test's child runs as: params["server_pids"] (the servers
    running from the install), this interpreter's prefix (the install's tree, its owner),
    params["unprivileged_user"]. Raises runas.NoAccount."""
    return runas.account(params.get("server_pids") or [], sys.prefix, params.get("unprivileged_user"))


def child_env(work: str, extra: dict) -> dict:
    """A child's environment: runas.environment(work) with PATH the interpreter's bin directory
    (a venv's ninja) before the system's, CUDA_HOME and CUDA_PATH as this probe has them (where
    root says CUDA is: torch's _find_cuda_home), then `extra`."""
    env = runas.environment(work, {"PATH": os.path.dirname(os.path.abspath(sys.executable)) + ":" + runas.SYSTEM_PATH})
    for k in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(k):
            env[k] = os.environ[k]
    env.update(extra)
    return env


def build(params: dict) -> dict:
    """Build an extension with torch.utils.cpp_extension.load, or a triton build, in a child
    process run as account(params), in a private directory WORK (runas.private_dir) holding a
    copy of src_dir (WORK/src) and the build (WORK/build), copied back into build_dir checked.

    params: src_dir (uploaded package), build_dir (staging), name (module name), sources (relative
    to src_dir), cflags, cuda_cflags, ldflags, arch (TORCH_CUDA_ARCH_LIST, None for cpu), max_jobs
    (cap on MAX_JOBS, default 4), deadline_s (default 1800 s, waiting for the lock included),
    lock_path (default BUILD_DIR.lock), cache_dir (default CACHE_DIR: ccache's directory per uid
    below it, kept between builds), server_pids, unprivileged_user (account). kind "triton"
    (engine/kernels/package.py TritonBackend's parameters): module (.py relative to src_dir),
    build, load (its function names) in place of sources and flags; the child calls
    module.build(arch as an int: "9.0" -> 90, WORK/build/kernels), then BUILD_DIR/NAME.py is
    written by root (_TRITON_MODULE) and is the module_path; "manifest" is what build returned.
    An flock on lock_path serialises builds. The child's environment: child_env with MAX_JOBS,
    CCACHE_DIR, CCACHE_BASEDIR (WORK: the same sources under another build key hit the cache).
    At the deadline the child's whole process group is killed. Returns {"ok", "module_path",
    "log_path", "log_tail" (failure only), "rc", "timed_out", "seconds", "pgid", "ran_as"}.
    """
    start = time.monotonic()
    deadline = start + float(params.get("deadline_s", 1800))
    build_dir = os.path.abspath(params["build_dir"])
    os.makedirs(build_dir, exist_ok=True)
    log_path = build_dir + ".log"  # beside the build, which is replaced by the child's checked copy
    out = {"ok": False, "module_path": None, "log_path": log_path, "log_tail": None, "rc": None,
           "timed_out": False, "seconds": 0.0, "pgid": None, "ran_as": None}
    lock_path = params.get("lock_path") or build_dir + ".lock"
    lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    work = None
    try:
        if not proc.flock(lock_fd, deadline):
            out.update(timed_out=True, log_tail="another build held %s until the deadline" % lock_path)
            return out
        acct = account(params)
        out["ran_as"] = {"uid": acct.uid, "why": acct.why}
        work = runas.private_dir(acct)
        wsrc, wbuild = os.path.join(work, "src"), os.path.join(work, "build")
        copy_in(params["src_dir"], work, "src")
        os.mkdir(wbuild, 0o755)
        if os.geteuid() == 0:
            os.chown(wbuild, acct.uid, acct.gid)
        result_path = os.path.join(work, "build-result.json")
        jobs = max(1, min(int(params.get("max_jobs", 4)), os.cpu_count() or 1))
        extra = {"MAX_JOBS": str(jobs), "CCACHE_BASEDIR": work,
                 "CCACHE_DIR": cache_dir(params.get("cache_dir") or CACHE_DIR, acct)}
        if params.get("arch"):
            extra["TORCH_CUDA_ARCH_LIST"] = params["arch"]
        if params.get("kind") == "triton":
            script, args = _TRITON_BUILD, _triton_args(params, wsrc, wbuild, result_path)
        else:
            script = _BUILD
            args = {"name": params["name"], "build_dir": wbuild, "result": result_path,
                    "sources": [os.path.join(wsrc, x) for x in params["sources"]],
                    "cflags": params.get("cflags") or [], "cuda_cflags": params.get("cuda_cflags") or [],
                    "ldflags": params.get("ldflags") or []}
        with open(log_path, "wb") as log:
            child = runas.spawn([sys.executable, "-c", script, json.dumps(args)], acct, child_env(work, extra),
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=wbuild)
            out["pgid"] = child.pid
            out["rc"], out["timed_out"] = runas.finish(child, deadline)
        done = _result(result_path, acct.uid) if out["rc"] == 0 else None
        if done is None:
            out["log_tail"] = proc.tail(log_path)
            return out
        out["module_path"] = _inside(done.get("module_path"), wbuild, build_dir) if params.get("kind") != "triton" else None
        replace_tree(work, "build", build_dir)
        if params.get("kind") == "triton":
            out["manifest"] = done.get("manifest")
            out["module_path"] = _write_triton_module(params, _triton_args(params, os.path.abspath(params["src_dir"]),
                                                                           build_dir, result_path))
        out["ok"] = out["module_path"] is not None
        if not out["ok"]:
            out["log_tail"] = "the build named no module inside its build directory: %r" % (done.get("module_path"),)
        return out
    except (copy.Refused, runas.NoAccount, OSError, subprocess.SubprocessError) as e:
        out["log_tail"] = "%s%s" % (out["log_tail"] + "\n" if out["log_tail"] else "", e)
        return out
    finally:
        os.close(lock_fd)
        if work:
            runas.remove(work)
        out["seconds"] = round(time.monotonic() - start, 3)


CACHE_DIR = "/var/cache/fleetctl-kbuild"  # ccache's directories, one per account (cache_dir)


def cache_dir(root: str, acct) -> str:
    """ROOT/<uid>: `acct`'s ccache directory, kept between builds: ROOT made root's 0755 when
    missing, <uid> made the account's 0700 when missing; an existing one must be a directory (no
    link) of that uid. Raises copy.Refused, OSError."""
    os.makedirs(root, 0o755, exist_ok=True)
    top = os.open(root, copy.DIR)
    try:
        name = str(acct.uid)
        try:
            os.mkdir(name, 0o700, dir_fd=top)
            if os.geteuid() == 0:
                os.chown(name, acct.uid, acct.gid, dir_fd=top, follow_symlinks=False)
        except FileExistsError:
            pass
        st = os.stat(name, dir_fd=top, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != acct.uid:
            raise copy.Refused("%s/%s is not a directory of uid %d: no ccache for its builds" % (root, name, acct.uid))
    finally:
        os.close(top)
    return os.path.join(root, name)


def _result(path: str, uid: int):
    """The child's result file (JSON object) at `path`, read as hostile (runas.read_output: no
    link, a regular file of `uid`, MAX_RESULT bytes at most); None when it is not so."""
    try:
        data = runas.read_output(path, uid, MAX_RESULT)
        doc = json.loads(data.decode("utf-8")) if data is not None else None
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def _inside(path, work_build: str, build_dir: str):
    """`path` (what the child named) as the same file under `build_dir`, when it lies inside
    `work_build` (no `..`); else None."""
    if not isinstance(path, str) or not os.path.isabs(path):
        return None
    norm = os.path.normpath(path)
    if not norm.startswith(work_build + "/") or ".." in norm.split("/"):
        return None
    return build_dir + norm[len(work_build):]


def copy_in(src: str, into: str, name: str) -> None:
    """Directory `src` copied as `into`/`name` (copy.tree: root's files, checked, bounded).
    Raises copy.Refused, OSError."""
    parent, leaf = os.path.split(os.path.abspath(src))
    sfd, dfd = os.open(parent, copy.DIR), os.open(into, copy.DIR)
    try:
        copy.tree(sfd, leaf, dfd, name, src)
    finally:
        os.close(sfd)
        os.close(dfd)


def replace_tree(work: str, name: str, dest: str) -> None:
    """`dest` (root's) replaced by a checked copy (copy_in) of `work`/`name`: copied beside it as
    .NAME.<random>, the old one removed, the copy renamed into place. Raises copy.Refused, OSError."""
    parent, leaf = os.path.split(dest)
    tmp = ".%s.%s" % (leaf, os.urandom(6).hex())
    copy_in(os.path.join(work, name), parent, tmp)
    pfd = os.open(parent, copy.DIR)
    try:
        try:
            safefs.rmtree(pfd, leaf)
        except FileNotFoundError:
            pass  # the first build of this key
        except (OSError, safefs.UnsafePath) as e:
            safefs.rmtree(pfd, tmp)
            raise copy.Refused("cannot replace %s: %s" % (dest, e))
        os.rename(tmp, leaf, src_dir_fd=pfd, dst_dir_fd=pfd)
    finally:
        os.close(pfd)


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
    """Run the package's test module on a built module in a fresh process, as account(params),
    its working directory and HOME a private directory of that uid: the package and the module
    are read where they are, the build's published copy (publish's `untested`: root's files,
    world-readable, that the account cannot change), so what is tested is what is activated.

    params: src_dir, module_path, test (relative to src_dir), reference ("file.py:func"),
    tolerances ({dtype: [atol, rtol]}), device ("cpu"/"cuda"), deadline_s (default 600 s),
    server_pids, unprivileged_user. The test prints one JSON line and exits 0 when it passes.
    Returns {"ok", "rc", "timed_out", "result" (the test's JSON or None), "stderr_tail",
    "seconds", "ran_as"}.
    """
    start = time.monotonic()
    out = {"ok": False, "rc": None, "timed_out": False, "result": None, "stderr_tail": "", "seconds": 0.0,
           "ran_as": None}
    work = None
    try:
        acct = account(params)
        out["ran_as"] = {"uid": acct.uid, "why": acct.why}
        work = runas.private_dir(acct)
        src = os.path.abspath(params["src_dir"])
        cmd = [sys.executable, os.path.join(src, params["test"]), "--module", os.path.abspath(params["module_path"]),
               "--device", params["device"], "--reference", params["reference"],
               "--tolerances", json.dumps(params["tolerances"])]
        child = runas.spawn(cmd, acct, child_env(work, {}), cwd=work)
        (stdout, stderr), timed_out, _ = runas.collect(child, b"", time.monotonic() + float(params.get("deadline_s", 600)))
        out["rc"], late = runas.finish(child, time.monotonic())
        out["timed_out"] = timed_out or late
    except (copy.Refused, runas.NoAccount, OSError, subprocess.SubprocessError) as e:
        out["stderr_tail"] = str(e)
        return out
    finally:
        if work:
            runas.remove(work)
        out["seconds"] = round(time.monotonic() - start, 3)
    lines = stdout.decode("utf-8", "replace").strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except (ValueError, RecursionError):
        result = None
    out.update(ok=out["rc"] == 0 and isinstance(result, dict) and result.get("ok") is True,
               result=result if isinstance(result, dict) else None,
               stderr_tail=stderr.decode("utf-8", "replace")[-proc.LOG_TAIL_BYTES:])
    return out
