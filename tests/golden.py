"""Golden outputs: what fleetctl's commands print (`--json`, exit status, stderr), recorded under
tests/golden/ and compared byte for byte, so a change that should change no behaviour (a refold)
is shown to change none.

A run is normalised before it is compared: whatever differs between two runs of the same command
on the same hosts goes to a placeholder (durations, pids, sizes that grow with caches, host keys
made at each lab up, change ids with their time), and so do the paths of this checkout and of the
run's temporary directories. With FLEETCTL_GOLDEN=record the tests write the files instead
(review the diff before committing it).

What else differs between two runs, each seen flapping on the lab (tests/fleet/test_golden_lab.py):
- pids in text ("running server pid 7", "... pid 1054 eager_routed ...", the route evidence file
  route-evidence/UID/PID.json): a host's first lab up after boot starts its server at another pid;
- the machine's `boot_id` (a route evidence record's: another after each boot of the machine);
- times: `time` (a ledger entry's ISO time), `started_at`/`ended_at` (a recorded run's), `written`
  (a route evidence record's Unix time), `start_time` (a process's, clock ticks after boot), run
  ids (`20261205T205216Z-c7ae11`: their start time and a random tail);
- measurements: the smoke gate's latency detail ("median e2e_latency 0.0163 s vs baseline 0.0161 s
  (1.02x, ..."; the limit and its verdict word are kept), a load run's figures (SGLang's result
  names: every float `*_ms`, `*_throughput`, `duration`, `concurrency`; integer counts such as
  `completed` and `total_output_tokens` are kept) and the same figures in the client's `tail`
  lines (a label with (ms), (s), (req/s), (tok/s), or Concurrency), the client's temp directory
  (/tmp/fleetctl-child-XXXXXXXX: a child's private directory, probes/runas.py);
- the route evidence's output `logprobs` (torch on the CPU: they differ in their 7th decimal from
  run to run, seen in CI on 2026-12-07; the gate's verdict on them, within 0.02, is kept);
- a kernel build: its `seconds` (a float: a ccache hit or a compile), its reference test's `seed`
  (test.seed: os.urandom each run) and so each case's `max_abs_err`, and status's space used by
  kernel builds (space.kernels when not 0: the build's log and objects vary by some bytes);
- the HTML report's text (normalise_page): its times, durations, latencies and throughputs.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent / "golden"
ROOT = GOLDEN.parent.parent
RECORD = os.environ.get("FLEETCTL_GOLDEN") == "record"

# keys whose values differ from run to run (seconds, pids, bytes of caches that grow), or that
# measure the probes' own source (upload_bytes: the bundles' size, which any edit of a probe
# changes; the run's number of probes, `probes`, is kept; made: when a dispatch table was made)
VOLATILE_KEYS = frozenset({"pid", "total", "upload_bytes", "tokens_per_s", "build_key", "phases_s", "timings",
                           "change_id", "cache_bytes", "made",
                           # times (see the module docstring) and a kernel test's error on random inputs
                           "time", "started_at", "ended_at", "written", "start_time", "max_abs_err",
                           # the machine's boot (/proc/sys/kernel/random/boot_id): another each boot
                           "boot_id"})
# keys volatile only under one parent key: a kernel's reference test's random seed (a load
# workload's seed, 42, is kept), the bytes of kernel builds in status's space used (0 is kept)
VOLATILE_UNDER = {("test", "seed"), ("space", "kernels")}
# a load run's measured figures (floats; the workload's integer concurrency is kept)
_MEASURED = re.compile(r"(_ms|_throughput)$|^(duration|concurrency|seconds)$")
_KEY = re.compile(r"AAAA[0-9A-Za-z+/]{20,}={0,2}")
_CHANGE_ID = re.compile(r"\d{8}T\d{6}Z-[\w.-]+?-[0-9a-f]{6}")
_RUN_ID = re.compile(r"\b\d{8}T\d{6}Z-[0-9a-f]{6}\b")
_PID = re.compile(r"\bpid \d+\b")
_EVIDENCE = re.compile(r"(route-evidence/\d+/)\d+\.json")
_LATENCY = re.compile(r"(median \S+ )\d+\.\d+ s vs baseline \d+\.\d+ s \((?:\d+\.\d+|inf)x")
_LOAD_TMP = re.compile(r"/tmp/fleetctl-child-[a-z0-9_]{8}\b")
# a benchmark client's summary line whose figure is measured: "P99 ITL (ms):      5.27     " (the
# padding after it: the figure's width)
_TAIL_FIGURE = re.compile(r"^((?:[^:]*\((?:ms|s|req/s|tok/s)\)|Concurrency)[^:]*:\s+)-?\d+(?:\.\d+)?\s*$")
# the HTML report's text: its times ("2026-12-05 20:52:34Z", a timeline tick "12-05 20:52:16"),
# durations ("0.82 s") and figures ("13.15 ms", "646 tok/s")
_PAGE_TIME = re.compile(r"\b(?:\d{4}-)?\d{2}-\d{2} \d{2}:\d{2}(?::\d{2})?Z?")
_PAGE_FIGURE = re.compile(r"(?<![\d.])\d+(?:\.\d{2})? (s|ms|tok/s)\b")  # as report/svg.py figure writes them


def _volatile(key: str, value, parent: str = "") -> bool:
    if key in VOLATILE_KEYS:
        return True
    if (parent, key) in VOLATILE_UNDER:
        return bool(value)
    if _MEASURED.search(key) and isinstance(value, float):
        return True
    if key == "build" and isinstance(value, str):
        return True  # a dispatch table's build key (build_key's)
    if key == "servers" and isinstance(value, list) and all(isinstance(v, int) for v in value):
        return bool(value)  # an install's servers, by pid
    if key == "logprobs" and isinstance(value, list) and any(isinstance(v, float) for v in value):
        return True  # the stand-in's output logprobs (torch on CPU: the last digits move between runs)
    # durations: every "..._s" key but the configured waits (ints from the inventory or playbook)
    return key.endswith("_s") and isinstance(value, float)


def normalise(value, paths: dict[str, str], key: str = "", parent: str = ""):
    """`value` (a JSON document) with volatile values and run-specific paths replaced; `paths`:
    {path: placeholder}, longest first. `key`: the value's key (a list's items keep the list's),
    `parent`: the key of the object holding it."""
    if _volatile(key, value, parent) and value is not None:
        return f"<{key}>"
    if isinstance(value, dict):
        return {k: normalise(v, paths, k, key) for k, v in value.items()}
    if isinstance(value, list):
        return [normalise(v, paths, key, parent) for v in value]
    if isinstance(value, str):
        text = normalise_text(value, paths)
        return _TAIL_FIGURE.sub(r"\1<measured>", text) if key == "tail" else text
    return value


def normalise_text(text: str, paths: dict[str, str]) -> str:
    """`text` with run-specific paths, host keys, change and run ids, pids, the smoke gate's
    measured latencies and a load client's temp directory replaced."""
    for path, placeholder in sorted(paths.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(path, placeholder)
    text = _CHANGE_ID.sub("<change-id>", _KEY.sub("<host-key>", text))
    text = _EVIDENCE.sub(r"\1<pid>.json", _PID.sub("pid <pid>", _RUN_ID.sub("<run-id>", text)))
    text = _LATENCY.sub(r"\1<s> s vs baseline <s> s (<ratio>x", text)
    return _LOAD_TMP.sub("/tmp/fleetctl-child-<tmp>", text)


def normalise_page(text: str) -> str:
    """The HTML report's text (one line per element) with its times and measured figures
    replaced (after normalise_text)."""
    return _PAGE_FIGURE.sub(r"<n> \1", _PAGE_TIME.sub("<time>", text))


def record(name: str, argv: list[str], rc: int, stdout: str, stderr: str, paths: dict[str, str]) -> str:
    """The golden text of one run: argv, exit status, stdout (parsed and normalised when JSON), stderr."""
    try:
        out = normalise(json.loads(stdout), paths)
    except json.JSONDecodeError:
        out = normalise_text(stdout, paths)
    doc = {"argv": [normalise_text(a, paths) for a in argv], "exit": rc, "stdout": out,
           "stderr": normalise_text(stderr, paths)}
    return json.dumps(doc, indent=1, sort_keys=False) + "\n"


def check(name: str, text: str) -> None:
    """Compare `text` with tests/golden/NAME.json (write it under FLEETCTL_GOLDEN=record);
    an AssertionError shows the unified diff."""
    path = GOLDEN / f"{name}.json"
    if RECORD:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.is_file(), f"no golden {path}: record it with FLEETCTL_GOLDEN=record"
    want = path.read_text()
    if text != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True), str(path), "this run"))
        raise AssertionError(f"{name}: output differs from its golden:\n{diff[:6000]}")
