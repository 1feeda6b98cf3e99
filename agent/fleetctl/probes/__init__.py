"""Remote probes: stdlib-only Python modules sent over SSH stdin to the host's own interpreter.

A probe module defines `main(params: dict) -> dict`. `bundle()` packs the probe modules it needs
with their parameters into one JSON document (zlib-compressed); `WRAPPER` (run as `python -c WRAPPER`) reads it from
stdin, loads each module into `sys.modules` in order, calls the main module's `main(params)` and
prints the JSON result after a marker line. Nothing is written to the host to do this.
A probe can re-run itself under another interpreter (see facts.py) with `FLEETCTL_BUNDLE`,
the bundle's JSON text, and `FLEETCTL_WRAPPER`, which the wrapper leaves in each module's globals.
A bundle that starts with `scancache` carries `code_key`, the sha256 of its sources: the modules
after it are compiled once per interpreter build and kept on the host (scancache.CodeCache).
"""

from __future__ import annotations

import hashlib
import json
import zlib
from functools import lru_cache
from importlib import resources

MARKER = "--fleetctl-probe-result--"
# The facts probe and the helpers it imports, in load order (gather's inspect; the trust probe
# runs facts.untrusted with the same bundle).
FACTS_MODULES = ["scancache", "redact", "callsites", "procs", "containers", "gpus", "locate", "facts"]

WRAPPER = r"""
import json, sys, types, zlib
try:
    data = sys.stdin.buffer.read()
    raw = (data if data[:1] == b"{" else zlib.decompress(data)).decode("utf-8")
    b = json.loads(raw)
    kept = None
    for name, src in b["modules"]:
        m = types.ModuleType(name)
        m.__dict__.update(FLEETCTL_BUNDLE=raw, FLEETCTL_WRAPPER=b["wrapper"])
        sys.modules[name] = m
        code = kept and kept.get(name)
        if code is None:
            code = compile(src, "<fleetctl probe %s>" % name, "exec")
            if kept:
                kept.add(name, code)
        exec(code, m.__dict__)
        if name == "scancache" and b.get("code_key"):
            kept = m.CodeCache(b["code_key"])
    if kept:
        kept.save()
    out = sys.modules[b["main"]].main(b["params"])
except BaseException:
    import traceback
    out = {"__probe_error__": traceback.format_exc()}
sys.stdout.write("\n%s\n%s\n" % (MARKER, json.dumps(out)))
""".replace("MARKER", repr(MARKER))


class ProbeError(Exception):
    """A probe crashed on the host or printed no result; the message carries its traceback."""


@lru_cache(maxsize=None)
def source(name: str) -> str:
    """The source text of probe module `name` (e.g. "facts")."""
    return resources.files(__package__).joinpath(f"{name}.py").read_text()


def sources_sha256(modules: list[str]) -> str:
    """sha256 (hex) of the sources of probe `modules` in order: the key of a host's scan cache,
    which a change to any bundled module invalidates (probes/scancache.py)."""
    h = hashlib.sha256()
    for m in modules:
        h.update(m.encode() + b"\0" + source(m).encode() + b"\0")
    return h.hexdigest()


def bundle(main: str, params: dict, modules: list[str] | None = None) -> bytes:
    """The stdin document that runs probe `main` with `params` (modules loaded in list order):
    the JSON text, zlib-compressed (about a quarter of the bytes; WRAPPER also takes it plain).
    + code_key (sources_sha256) when the first module is scancache: the host keeps the others
    compiled (see WRAPPER). The same bundle for many hosts is built once (4 ms each)."""
    return _bundle(main, json.dumps(params, sort_keys=True), tuple(modules or [main]))


@lru_cache(maxsize=16)
def _bundle(main: str, params_json: str, mods: tuple[str, ...]) -> bytes:
    doc = {"modules": [[m, source(m)] for m in mods], "main": main, "params": json.loads(params_json),
           "wrapper": WRAPPER}
    if mods[0] == "scancache":
        doc["code_key"] = sources_sha256(list(mods))
    return zlib.compress(json.dumps(doc).encode(), 6)


# The probes that import the install's own packages (kbuild: torch) and so need the site module.
# Every other probe is stdlib only and starts with `python -S`: site's work (sys.path from
# site-packages, every `.pth` file, sitecustomize) was a sixth of a warm facts probe's CPU
# (0.05 of 0.30 s on a 0.5.23 host, bench/results/NOTES.md), and a host's `.pth` files are code
# a stdlib probe has no reason to run. facts.ask starts an install's interpreter with its site.
SITE_PROBES = frozenset({"kbuild"})

# Runs WRAPPER ($0) with the interpreter the last facts probe ran under, recorded in this user's
# scan cache directory (scancache.cache_dir, scancache.INTERPRETER: a regular file of this user,
# not a link, naming an executable), else the first python3 or python on PATH, with the flags
# "$@" (command's). The record spares a warm run
# a version manager's shim (pyenv's python3 costs ~0.13 s of shell before Python starts).
_FINDER = ('if [ "$(id -u)" = 0 ]; then c=/var/lib/fleetctl/scan-cache; else c="${XDG_CACHE_HOME:-$HOME/.cache}/fleetctl"; fi; '
           'if [ -f "$c/interpreter" ] && [ ! -L "$c/interpreter" ] && [ -O "$c/interpreter" ] && '
           'read -r p < "$c/interpreter" && [ -x "$p" ]; '
           'then exec "$p" "$@" -c "$0"; fi; '
           'for p in python3 python; do command -v "$p" >/dev/null 2>&1 && exec "$p" "$@" -c "$0"; done; '
           'echo "fleetctl: no python3 or python on PATH" >&2; exit 127')


def command(python: str | None, main: str) -> list[str]:
    """The argv that runs WRAPPER for probe `main` with `python`, or (None) with the recorded
    interpreter or the first python3/python on PATH (see _FINDER). A probe not in SITE_PROBES
    starts with `-S`: no site module, so no site-packages on sys.path and no `.pth` file run."""
    flags = [] if main in SITE_PROBES else ["-S"]
    if python:
        return [python, *flags, "-c", WRAPPER]
    return ["sh", "-c", _FINDER, WRAPPER, *flags]


def parse_output(stdout: bytes, stderr: bytes, exit_code: int) -> dict:
    """Extract the probe's JSON result from its output.

    Raises ProbeError when the probe crashed (its traceback included) or printed no result.
    """
    text = stdout.decode("utf-8", "replace")
    idx = text.rfind(MARKER + "\n")
    if idx < 0:
        tail = (stderr.decode("utf-8", "replace") or text).strip()[-2000:]
        raise ProbeError(f"probe printed no result (exit {exit_code}): {tail or 'no output'}")
    try:
        out = json.loads(text[idx + len(MARKER) + 1:])
    except ValueError as e:
        raise ProbeError(f"probe result is not JSON (output cut short?): {e}") from None
    if isinstance(out, dict) and "__probe_error__" in out:
        raise ProbeError("probe failed on the host:\n" + out["__probe_error__"].strip())
    return out
