"""The kbuild probe's build and test actions (stdlib only, Python 3.8+), each in a child process of
this interpreter (the install's: its torch and triton, imported by the children only).
  build  in its own process group, under an flock and a deadline, into an explicit build
         directory: torch.utils.cpp_extension.load (cpu, cuda), or the package's triton module's
         build(arch, out_dir) (the ahead-of-time compile: no GPU, no nvcc); the log is kept in
         BUILD_DIR/build.log.
  test   the package's test module against the built module in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from . import proc


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


def build(params: dict) -> dict:
    """Build an extension with torch.utils.cpp_extension.load, or a triton build, in a child process.

    params: src_dir (uploaded package), build_dir (staging), name (module name), sources (relative
    to src_dir), cflags, cuda_cflags, ldflags, arch (TORCH_CUDA_ARCH_LIST, None for cpu), max_jobs
    (cap on MAX_JOBS, default 4), deadline_s (default 1800 s, waiting for the lock included),
    lock_path (default BUILD_DIR.lock). kind "triton" (engine/kernels/package.py TritonBackend's parameters):
    module (.py relative to src_dir), build, load (its function names) in place of sources and
    flags; the child calls module.build(arch as an int: "9.0" -> 90, BUILD_DIR/kernels), then
    BUILD_DIR/NAME.py is written (_TRITON_MODULE) and is the module_path; "manifest" is what
    build returned.
    An flock on lock_path serialises builds; under it torch's own `lock` file in build_dir, which a
    killed build leaves behind (torch then waits forever), is removed. The child's environment:
    MAX_JOBS, PATH (proc.search_path), and CCACHE_BASEDIR (_cache_base) unless already set. At the
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
        if not proc.flock(lock_fd, deadline):
            out.update(timed_out=True, log_tail="another build held %s until the deadline" % lock_path)
            return out
        torch_lock = os.path.join(build_dir, "lock")
        if os.path.lexists(torch_lock):
            os.unlink(torch_lock)
            out["removed_stale_lock"] = True
        if os.path.exists(result_path):
            os.unlink(result_path)
        jobs = max(1, min(int(params.get("max_jobs", 4)), os.cpu_count() or 1))
        env = dict(os.environ, MAX_JOBS=str(jobs), PATH=proc.search_path(python))
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
            child = subprocess.Popen([python, "-c", script, json.dumps(args)], stdin=subprocess.DEVNULL,
                                     stdout=log, stderr=subprocess.STDOUT, cwd=build_dir, env=env,
                                     start_new_session=True, pass_fds=(lock_fd,))
            out["pgid"] = child.pid
            out["rc"], out["timed_out"] = proc.wait(child, deadline)
        if out["rc"] == 0 and os.path.exists(result_path):
            with open(result_path) as f:
                done = json.load(f)
            if params.get("kind") == "triton":
                out["manifest"], done["module_path"] = done["manifest"], _write_triton_module(params, args)
            out["module_path"], out["ok"] = done["module_path"], True
        else:
            out["log_tail"] = proc.tail(log_path)
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
    child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             cwd=src_dir, start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=float(params.get("deadline_s", 600)))
        timed_out = False
    except subprocess.TimeoutExpired:
        proc.killpg(child.pid)
        stdout, stderr = child.communicate()
        timed_out = True
    lines = stdout.decode("utf-8", "replace").strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except ValueError:
        result = None
    ok = child.returncode == 0 and isinstance(result, dict) and result.get("ok") is True
    return {"ok": ok, "rc": child.returncode, "timed_out": timed_out, "result": result,
            "stderr_tail": stderr.decode("utf-8", "replace")[-proc.LOG_TAIL_BYTES:],
            "seconds": round(time.monotonic() - start, 3)}


def _cache_base(src_dir: str, build_dir: str) -> str | None:
    """The directory above both the sources and the build (a build key's directory), or None when
    only / is. torch.utils.cpp_extension puts ccache (or sccache) before the compiler when it is
    on PATH (its _wrap_compiler); with CCACHE_BASEDIR there, ccache hashes the sources' paths
    relative to the build directory (ccache(1), base_dir), so the same sources under another build
    key compile once: without it every new key's absolute paths miss the cache."""
    common = os.path.commonpath([os.path.abspath(src_dir), build_dir])
    return None if common == os.sep else common
