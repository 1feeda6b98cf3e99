"""Record the --json documents of a real lab sequence for the HTML report's tests
(tests/unit/test_htmlreport.py, tests/machine/test_report_browser.py): each command's argv, exit
status, start and end (Unix seconds) and its `--json` document, one file per step, as run against
a lab of three stand-in hosts (lab-01 0.5.2, lab-02 0.5.23, lab-03 0.4.6.post5):

    fleetctl lab up --hosts 3 --releases 0.5.2,0.5.23,0.4.6.post5 --with-server --lab-id ID
    FLEETCTL_INVENTORY=/var/lib/fleetctl-lab/ID/hosts.yaml python3 tests/golden/history/record.py ID [KERNELS]
    fleetctl lab down --lab-id ID

KERNELS: the kernels directory to deploy from (default: the checkout's). The apply's load gate is
widened (a stand-in on a busy 2-core machine varies by 40% between runs) so that lab-01 passes
and lab-02, slowed 40 ms per concurrent request at its restart, still fails and is rolled back;
lab-03 (0.4.6.post5, no need_sort) is skipped. A line is then appended to lab-01's patched
model_runner.py outside fleetctl, which the later status runs report as drift; lab-01's last
change (the kernel) is rolled back, and a recover finds nothing pending. The documents are kept
as the commands printed them (not normalised: the report reads them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
PATCHED = "/opt/sglang/venv/lib/python3.11/site-packages/sglang/srt/model_executor/model_runner.py"
WIDE = ["--max-throughput-drop", "0.5", "--max-itl-rise", "2", "--max-ttft-rise", "2"]
LOAD = ["--load-prompts", "4", "--load-concurrency", "2", "--load-input-len", "32", "--load-output-len", "8"]
# (file name, fleetctl argv), or (None, a `lab fault` argv) or ("ssh", argv) for a step recorded nowhere
STEPS = [
    ("01-inspect", ["inspect", "all"]),
    ("02-status", ["status", "all"]),
    ("03-validate", ["validate", "all", "--repeat", "1"]),
    ("04-validate-load", ["validate", "all", "--repeat", "1", "--load", "smoke", *LOAD]),
    ("05-apply-check-diff", ["apply", "defrag-tier0", "all", "--check", "--diff"]),
    (None, ["lab", "fault", "lab-02", "contention", "40", "--at-restart"]),
    ("06-apply-gate-load", ["apply", "defrag-tier0", "all", "--yes", "--repeat", "1", "--gate", "load", *LOAD, *WIDE]),
    (None, ["lab", "fault", "lab-02", "behave"]),
    ("07-status", ["status", "all"]),
    ("08-deploy-kernel-check", ["deploy", "kernel", "verify_attention", "lab-01", "--check", "KERNELS"]),
    ("09-deploy-kernel", ["deploy", "kernel", "verify_attention", "lab-01", "--yes", "--repeat", "1", "KERNELS"]),
    ("10-validate-load", ["validate", "all", "--repeat", "1", "--load", "smoke", *LOAD]),
    ("ssh", ["ssh", "lab-01", f"echo '# edited by hand' >> {PATCHED}"]),
    ("11-status", ["status", "all"]),
    ("12-inspect", ["inspect", "all"]),
    ("13-rollback", ["rollback", "--last", "lab-01", "--yes"]),
    ("14-recover", ["recover", "all", "--yes"]),
    ("15-status", ["status", "all"]),
]


def main(lab_id: str, kernels: str | None) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "agent"))
    for name, argv in STEPS:
        if "KERNELS" in argv:
            argv = [a for a in argv if a != "KERNELS"] + (["--kernels-dir", kernels] if kernels else [])
        cmd = [sys.executable, "-m", "fleetctl.cli", *argv]
        if name == "ssh":
            subprocess.run(argv, check=True)
            continue
        if name is None:
            subprocess.run([*cmd, "--lab-id", lab_id], check=True, env=env, cwd=ROOT)
            continue
        started = time.time()
        r = subprocess.run([*cmd, "--json"], capture_output=True, text=True, env=env, cwd=ROOT)
        ended = time.time()
        doc = json.loads(r.stdout)
        rec = {"argv": argv, "exit": r.returncode, "started_at": round(started, 3), "ended_at": round(ended, 3),
               "doc": doc}
        (HERE / f"{name}.json").write_text(json.dumps(rec, indent=1) + "\n")
        print(f"{name}: exit {r.returncode}, {ended - started:.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
