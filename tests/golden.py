"""Golden outputs: what fleetctl's commands print (`--json`, exit status, stderr), recorded under
tests/golden/ and compared byte for byte, so a change that should change no behaviour (a refold)
is shown to change none.

A run is normalised before it is compared: whatever differs between two runs of the same command
on the same hosts goes to a placeholder (durations, pids, sizes that grow with caches, host keys
made at each lab up, change ids with their time), and so do the paths of this checkout and of the
run's temporary directories. With FLEETCTL_GOLDEN=record the tests write the files instead
(review the diff before committing it).
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
                           "change_id", "cache_bytes", "made"})
_KEY = re.compile(r"AAAA[0-9A-Za-z+/]{20,}={0,2}")
_CHANGE_ID = re.compile(r"\d{8}T\d{6}Z-[\w.-]+?-[0-9a-f]{6}")


def _volatile(key: str, value) -> bool:
    if key in VOLATILE_KEYS:
        return True
    if key == "build" and isinstance(value, str):
        return True  # a dispatch table's build key (build_key's)
    if key == "servers" and isinstance(value, list) and all(isinstance(v, int) for v in value):
        return bool(value)  # an install's servers, by pid
    # durations: every "..._s" key but the configured waits (ints from the inventory or playbook)
    return key.endswith("_s") and isinstance(value, float)


def normalise(value, paths: dict[str, str], key: str = ""):
    """`value` (a JSON document) with volatile values and run-specific paths replaced; `paths`:
    {path: placeholder}, longest first."""
    if _volatile(key, value) and value is not None:
        return f"<{key}>"
    if isinstance(value, dict):
        return {k: normalise(v, paths, k) for k, v in value.items()}
    if isinstance(value, list):
        return [normalise(v, paths, key) for v in value]
    if isinstance(value, str):
        return normalise_text(value, paths)
    return value


def normalise_text(text: str, paths: dict[str, str]) -> str:
    """`text` with run-specific paths, host keys and change ids replaced."""
    for path, placeholder in sorted(paths.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(path, placeholder)
    return _CHANGE_ID.sub("<change-id>", _KEY.sub("<host-key>", text))


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
