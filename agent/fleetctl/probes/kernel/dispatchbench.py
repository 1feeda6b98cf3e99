"""Remote probe: run a kernel package's dispatch benchmark (kernels/verify_attention/dispatch_bench.py) with
this interpreter (the one SGLang runs: its torch, triton and sglang) in a fresh process, under a deadline.

main(params) params: src_dir (the build's published package, absolute: readable by any uid), script (its file
name there), request (the benchmark's JSON request, sent on its stdin), deadline_s (default 300 s: then the
child's whole process group is killed), server_pids, unprivileged_user. The script must be a regular file
reached from / without a link (safefs). The child runs `python -I SCRIPT` (its site: the install's code) as
an unprivileged uid (runas.account: the install's server's, else the install's owner, else nobody or the
inventory's fleetctl_unprivileged_user; never root), with an environment built from nothing (runas: HOME,
TMPDIR and TRITON_CACHE_DIR in a private directory: Triton builds its launcher there, as that uid).
Returns {"ok": exit 0 and an answer, "rc", "timed_out", "answer": the last stdout line as JSON (a dict) or
None, "stderr_tail", "seconds", "ran_as": {uid, why}}. torch is never imported here. Stdlib only
(Python 3.8+).
"""

import json
import os
import subprocess
import sys
import time

from .. import runas, safefs

TAIL_BYTES = 4000
MAX_ANSWER = 8 << 20


def main(params):
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
    acct = runas.account(params.get("server_pids") or [], sys.prefix, params.get("unprivileged_user"))
    try:
        ran = runas.run([sys.executable, "-I", path], acct, json.dumps(params["request"]).encode(),
                        float(params.get("deadline_s", 300)), limit=MAX_ANSWER)
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError("the dispatch benchmark cannot start as uid %d (%s): %s" % (acct.uid, acct.why, e))
    lines = ran.stdout.decode("utf-8", "replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except (ValueError, RecursionError):
        answer = None
    if not isinstance(answer, dict):
        answer = None
    return {"ok": ran.returncode == 0 and answer is not None, "rc": ran.returncode, "timed_out": ran.timed_out,
            "answer": answer, "stderr_tail": ran.stderr.decode("utf-8", "replace")[-TAIL_BYTES:],
            "seconds": round(time.monotonic() - start, 3), "ran_as": {"uid": acct.uid, "why": acct.why}}
