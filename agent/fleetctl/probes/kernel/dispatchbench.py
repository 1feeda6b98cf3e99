"""Remote probe: run a kernel package's dispatch benchmark (kernels/verify_attention/dispatch_bench.py) with
this interpreter (the one SGLang runs: its torch, triton and sglang) in a fresh process, under a deadline.

main(params): params src_dir (the build's uploaded package, absolute), script (its file name there),
request (the benchmark's JSON request, sent on its stdin), deadline_s (default 300 s: then the child's
whole process group is killed). The interpreter's site files are checked first (trust.untrusted: the
child runs with its site, as root), then what the benchmark imports (IMPORTS: every directory of the
import path and each package's tree, trust.untrusted_imports: an editable install from another user's
checkout is refused, never imported), and the script must be a regular file reached from / without a link
(safefs); the child runs `python -I` (no PYTHON* variables, no user site).
Returns {"ok": exit 0 and an answer, "rc", "timed_out", "answer": the last stdout line as JSON
(a dict) or None, "stderr_tail", "seconds"}. torch is never imported here. Stdlib only (Python 3.8+).
"""

import json
import os
import signal
import subprocess
import sys
import time

from .. import safefs, trust

TAIL_BYTES = 4000
MAX_ANSWER = 8 << 20


# what the benchmark imports (kernels/verify_attention/dispatch_bench.py): the install's own code, run as root
IMPORTS = ("sglang", "triton", "torch")


def main(params):
    why = trust.untrusted(sys.executable)
    if why:
        raise RuntimeError("interpreter %s refused: %s (fleetctl runs it as root)" % (sys.executable, why))
    import site
    site.main()  # the child's import path, as `python -I` with its site gets it
    why = trust.untrusted_imports(IMPORTS)
    if why:
        raise RuntimeError("not measuring: root would import code another user may change: %s" % why)
    start = time.monotonic()
    src = params["src_dir"]
    name = params["script"]
    if "/" in name or name in (".", ".."):
        raise ValueError("script %r is not a file name" % name)
    path = os.path.join(src, name)
    dfd = safefs.open_dir(src)
    try:
        os.close(safefs.open_regular(dfd, name, path))
    finally:
        os.close(dfd)
    proc = subprocess.Popen([sys.executable, "-I", path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=src, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(json.dumps(params["request"]).encode(),
                                          timeout=float(params.get("deadline_s", 300)))
        timed_out = False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stdout, stderr = proc.communicate()
        timed_out = True
    lines = stdout[-MAX_ANSWER:].decode("utf-8", "replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except (ValueError, RecursionError):
        answer = None
    if not isinstance(answer, dict):
        answer = None
    return {"ok": proc.returncode == 0 and answer is not None, "rc": proc.returncode, "timed_out": timed_out,
            "answer": answer, "stderr_tail": stderr.decode("utf-8", "replace")[-TAIL_BYTES:],
            "seconds": round(time.monotonic() - start, 3)}
