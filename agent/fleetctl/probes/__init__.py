"""Remote probes: stdlib-only Python modules sent over SSH stdin to the host's own interpreter.

The probes live in rooms of one idea each: the runtime at the top (this bundler, result, trust,
safefs, redact, enter), `facts/` (what a host has), `traffic/` (requests to running servers),
`kernel/` (kernel builds) and `change/` (the change actions and the ledger). A probe is named by
its dotted path under probes/ ("facts.host", "traffic.smoke", "safefs"). A probe module that runs
as a bundle's main defines `main(params: dict) -> dict`, and imports the probes it uses as modules
of a package, relatively: `from . import x` (its own room), `from .. import x` (the runtime),
`from ..room import x` (another room); those forms work in the bundle on the host, in this package,
and in the Ansible collection's module_utils, whose bundler follows them. `modules_for()` reads those
imports and gives a probe's bundle in load order; `bundle()` packs those modules with the
parameters into one JSON document (zlib-compressed); `WRAPPER` (run as `python -c WRAPPER`)
reads it from stdin, loads each module in order as PACKAGE.<name> into `sys.modules`, making the
sub-room packages on the way (so `from . import x` and `from ..facts import x` find the ones loaded
before it), calls the main module's `main(params)` and
prints the JSON result after a marker line (result.py). Nothing is written to the host to do this.
The probes need Python 3.8+: WRAPPER itself parses on any Python (2.7 too) and, first of all, exits
TOO_OLD_EXIT on one older than 3.8, before it reads the bundle, so the start (`command`) can go on
to another interpreter with the bundle still unread (see _START).
A probe can re-run itself under another interpreter (see facts.py) with `FLEETCTL_BUNDLE`,
the bundle's JSON text, and `FLEETCTL_WRAPPER`, which the wrapper leaves in each module's globals.
A bundle that holds `scancache` carries `code_key`, the sha256 of its sources: the modules after
it are compiled once per interpreter build and kept on the host (scancache.CodeCache), so
modules_for loads scancache (after the modules it imports) before the rest.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import zlib
from functools import lru_cache
from typing import Sequence

from . import result, trust

# The package a bundle's modules are loaded into on the host (WRAPPER): facts/host.py is
# sys.modules["fleetctl_probes.facts.host"] there.
PACKAGE = "fleetctl_probes"
# The probe whose CodeCache keeps the compiled modules loaded after it (see WRAPPER).
CODE_CACHE = "facts.scancache"

# Exit status of WRAPPER under a Python older than 3.8, and of a start that found no interpreter
# new enough (NO_PYTHON on stderr says which it tried).
TOO_OLD_EXIT = 3
# The line a start that found no interpreter to run the probes prints on stderr (exit
# TOO_OLD_EXIT, or 127 when it found none at all): NO_PYTHON and the reason.
NO_PYTHON = "fleetctl-no-python: "

WRAPPER = r"""
import sys
if sys.version_info < (3, 8):
    sys.stderr.write("\n%sthe probes need Python 3.8+; %s is %s\n" % (NO_PYTHON, sys.executable, sys.version.split()[0]))
    sys.exit(TOO_OLD_EXIT)
import json, types, zlib
try:
    data = sys.stdin.buffer.read()
    raw = (data if data[:1] == b"{" else zlib.decompress(data)).decode("utf-8")
    b = json.loads(raw)
    def package(full):
        p = sys.modules.get(full)
        if p is None:
            p = sys.modules[full] = types.ModuleType(full)
            p.__path__ = []
            head, _, tail = full.rpartition(".")
            if head:
                setattr(package(head), tail, p)
        return p
    package(PACKAGE)
    kept = None
    for name, src in b["modules"]:
        full = PACKAGE + "." + name
        head, _, tail = full.rpartition(".")
        m = types.ModuleType(full)
        m.__dict__.update(__package__=head, FLEETCTL_BUNDLE=raw, FLEETCTL_WRAPPER=b["wrapper"])
        sys.modules[full] = m
        setattr(package(head), tail, m)
        code = kept and kept.get(name)
        if code is None:
            code = compile(src, "<fleetctl probe %s>" % name, "exec")
            if kept:
                kept.add(name, code)
        exec(code, m.__dict__)
        if name == CODE_CACHE and b.get("code_key"):
            kept = m.CodeCache(b["code_key"])
    if kept:
        kept.save()
    out = sys.modules[PACKAGE + "." + b["main"]].main(b["params"])
except BaseException:
    import traceback
    out = {"__probe_error__": traceback.format_exc()}
sys.stdout.write("\n%s\n%s\n" % (MARKER, json.dumps(out)))
""".replace("MARKER", repr(result.MARKER)).replace("PACKAGE", repr(PACKAGE)).replace("CODE_CACHE", repr(CODE_CACHE)) \
    .replace("NO_PYTHON", repr(NO_PYTHON)).replace("TOO_OLD_EXIT", str(TOO_OLD_EXIT))


class ProbeError(Exception):
    """A probe crashed on the host or printed no result; the message carries its traceback."""


@lru_cache(maxsize=None)
def source(name: str) -> str:
    """The source text of probe module `name` (e.g. "facts.host": facts/host.py), the file under this one's directory read
    through this module's loader (a directory, or the zip Ansible runs the collection's
    module_utils from). Raises OSError (FileNotFoundError) when there is no such probe."""
    return __loader__.get_data(os.path.join(os.path.dirname(__file__), *name.split(".")) + ".py").decode("utf-8")


# A relative import statement: from a line's start (after its indentation) to the line's end, or
# to the closing parenthesis of a parenthesised one.
RELATIVE = re.compile(r"^[ \t]*from[ \t]+\.[^\n(]*(?:\([^)]*\)|[^\n]*)", re.M)


@lru_cache(maxsize=None)
def imports(name: str) -> tuple[str, ...]:
    """The probes that probe `name` imports (`from . import x`, `from .. import x`, `from ..room
    import x`, at any depth of its source), as probe names, in source order, each statement read
    with `ast`. Only the statements RELATIVE finds are parsed, not the whole source (a whole facts
    bundle's ast costs ~50 ms of every command); tests/unit/test_probe_bundles.py checks the reading
    equals a whole-source `ast.walk` for every probe. Raises ValueError for a relative import of
    another form (`from .x import y`: a name out of a module; one above probes/; one split by a
    backslash): probes import each other as modules of a package, one way only."""
    found = []
    text = source(name)
    here = name.split(".")[:-1]
    for m in RELATIVE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        try:
            node = ast.parse(m.group(0).strip()).body[0]
        except SyntaxError:
            node = None
        room = None
        if isinstance(node, ast.ImportFrom) and 1 <= node.level <= len(here) + 1:
            room = here[:len(here) - node.level + 1] + (node.module.split(".") if node.module else [])
        if room is None or len(room) > 1 or (node.module and node.level != 2):
            raise ValueError(f"probe {name} line {line}: probes import each other as `from . import x`, "
                             "`from .. import x` or `from ..room import x`")
        found += [n for n in (".".join(room + [a.name]) for a in node.names) if n not in found]
    return tuple(found)


def modules_for(main: str) -> list[str]:
    """The modules of probe `main`'s bundle in load order: `main` and every probe it imports,
    transitively (imports()), each after the ones it imports, `main` last. When CODE_CACHE is
    among them it comes first, after only what it imports itself: the modules loaded after it
    are the ones the host keeps compiled (WRAPPER). Raises ValueError when imports go in a
    circle, FileNotFoundError for an import of no probe."""
    return list(_load_order(main))


@lru_cache(maxsize=None)
def _load_order(main: str) -> tuple[str, ...]:
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in path:
            raise ValueError("probe imports go in a circle: " + " -> ".join(path[path.index(name):] + (name,)))
        if name not in order:
            for dep in imports(name):
                visit(dep, path + (name,))
            order.append(name)

    visit(main, ())
    if CODE_CACHE in order:
        order.clear()
        visit(CODE_CACHE, ())
        visit(main, ())
    return tuple(order)


def sources_sha256(modules: list[str]) -> str:
    """sha256 (hex) of the sources of probe `modules` in order: the key of a host's scan cache,
    which a change to any bundled module invalidates (probes/facts/scancache.py)."""
    h = hashlib.sha256()
    for m in modules:
        h.update(m.encode() + b"\0" + source(m).encode() + b"\0")
    return h.hexdigest()


def bundle(main: str, params: dict) -> bytes:
    """The stdin document that runs probe `main` with `params`, its modules (modules_for(main))
    loaded in order: the JSON text, zlib-compressed (about a quarter of the bytes; WRAPPER also
    takes it plain). + code_key (sources_sha256) when CODE_CACHE is among the modules: the host
    keeps the ones after it compiled (see WRAPPER). The params come last in the text, so the
    modules are compressed once per process (_compressed_head) and each host's bundle only
    adds its params to a copy of that compressor: 0.3 ms a host instead of 14 ms (issue 55:
    every host's params differ, its deadline_s at least)."""
    head, compressor = _compressed_head(main)
    c = compressor.copy()
    return head + c.compress((json.dumps(params, sort_keys=True) + "}").encode()) + c.flush()


def document(main: str, params: dict) -> dict:
    """The bundle of probe `main` with `params` as the WRAPPER reads it, before JSON and
    compression: {"modules": [[name, source]] (modules_for order), "main", "params", "wrapper"};
    no code_key (the collection's modules send it so, to an install's interpreter)."""
    return {"modules": [[m, source(m)] for m in _load_order(main)], "main": main, "params": params,
            "wrapper": WRAPPER}


@lru_cache(maxsize=16)
def _compressed_head(main: str) -> tuple[bytes, "zlib._Compress"]:
    """(what a zlib compressor gave for probe `main`'s document up to its params value, that
    compressor): the document's JSON text without params, its closing brace replaced by
    `, "params": `."""
    doc = document(main, {})
    del doc["params"]
    if CODE_CACHE in _load_order(main):
        doc["code_key"] = sources_sha256(modules_for(main))
    c = zlib.compressobj(6)
    return c.compress((json.dumps(doc)[:-1] + ', "params": ').encode()), c


# Every probe starts with `python -I -S`: no site module, so no site-packages on sys.path and no
# `.pth` file or sitecustomize run (site was a sixth of a warm facts probe's CPU, 0.05 of 0.30 s
# on a 0.5.23 host, bench/results/NOTES.md; a host's `.pth` files are code a stdlib probe has no
# reason to run). What needs the install's packages (the facts probe's locate, kbuild's preflight,
# build and test, the replay, the load client, the dispatch benchmark) runs in a child as an
# unprivileged uid (runas.py): the install's code never runs as root.
#
# Every start goes through trust.GUARD: an interpreter is checked by the same command that then
# runs it, or refused with REFUSED on stderr and exit 126 (parse_output raises Untrusted).
REFUSED = "fleetctl-untrusted: "
_REFUSE = 'printf \'\\n%s%s\\n\' "' + REFUSED + '" "$why" >&2; exit 126'
# python3 (else python) on PATH, checked by GUARD too, exec'd with -I -S and "$@" (path_python)
_PATH_PYTHON = ('for p in python3 python; do q=$(command -v "$p") || continue\n'
                '  if why=$(fleetctl_trust "$q"); then exec "$q" -I -S "$@"; fi\n  ' + _REFUSE + '\ndone\n'
                'echo "fleetctl: no python3 or python on PATH" >&2; exit 127')
# The interpreters tried when the first choice is older than 3.8 or absent, after the servers'
# own: the newest first, as Ansible's interpreter discovery lists them (INTERPRETER_PYTHON_FALLBACK).
FALLBACK_NAMES = tuple(f"python3.{n}" for n in range(14, 7, -1))

# The start of every guarded probe: `sh -c _START WRAPPER MODE NAMED [OPTION...]`. Each interpreter is
# cleared by GUARD on this start, then run (not exec'd) as `P -I -S [OPTION...] -c WRAPPER`;
# fleetctl_run goes on to the next only when P did not start the probes: WRAPPER's TOO_OLD_EXIT
# before it read the bundle, or Python 2's exit 2 for -I, and `P -V` says it is older than 3.8;
# or the shell's 126/127 (a version manager's shim for a version it does not have).
# 1. NAMED (the inventory's: an absolute path, or a name looked up on PATH as `/usr/bin/env NAME`
#    does), with its options; one GUARD refuses, or a name not on PATH, fails the start. Without
#    one: the interpreter the last facts probe ran under, recorded in this user's scan cache
#    directory (scancache.cache_dir, scancache.INTERPRETER: a directory and a regular file of this
#    user, not links; one GUARD refuses or that does not start is removed, review N10), then the
#    first of python3, python on PATH (one GUARD refuses fails the start). The record spares a
#    warm run a version manager's shim (pyenv's python3 costs ~0.13 s of shell before Python starts).
# 2. Only when those are absent or did not start, and MODE is not "only" (NAMED must run the probe
#    itself: an install's interpreter; NAMED's options are not given to these others): the
#    interpreters of running SGLang servers (/proc/PID/exe of each process whose command line
#    names sglang, when it is a python*), then python3, python and FALLBACK_NAMES on PATH; one
#    GUARD refuses is passed over.
# 3. None: NO_PYTHON and the sentence naming each one that did not start, exit TOO_OLD_EXIT (127
#    with none at all).
_START = trust.GUARD + r'''
w=$0; mode=$1; named=$2; shift 2
nl='
'
tried=; old=
fleetctl_run() {
  p=$1; shift
  tried="$tried$nl$p"
  "$p" -I -S "$@" -c "$w"; rc=$?
  case $rc in
    2|@OLD@) v=$("$p" -V 2>&1 </dev/null); v=${v%%"$nl"*}
      case $v in
        "Python 2."*|"Python 3."[0-7]|"Python 3."[0-7][!0-9]*) old="$old${old:+, }$p is ${v#Python }"; return 1;;
      esac;;
    126|127) old="$old${old:+, }$p did not start (exit $rc)"; return 1;;
  esac
  exit "$rc"
}
fleetctl_other() {
  case $1 in /*) ;; *) return 0;; esac
  case "$tried$nl" in *"$nl$1$nl"*) return 0;; esac
  if fleetctl_trust "$1" >/dev/null; then fleetctl_run "$1"; else tried="$tried$nl$1"; fi
}
if [ -n "$named" ]; then
  case $named in
    /*) p=$named;;
    *) p=$(command -v -- "$named") || { @SAY@ "the inventory's interpreter $named is not on this host's PATH" >&2; exit 127; };;
  esac
  why=$(fleetctl_trust "$p") || { @REFUSE@; }
  fleetctl_run "$p" "$@"
  [ "$mode" != only ] || { @SAY@ "the probes need Python 3.8+; $old" >&2; exit @OLD@; }
else
  if [ "$(id -u)" = 0 ]; then c=/var/lib/fleetctl/scan-cache; else c="${XDG_CACHE_HOME:-$HOME/.cache}/fleetctl"; fi
  if [ -d "$c" ] && [ ! -L "$c" ] && [ -O "$c" ] && [ -f "$c/interpreter" ] && [ ! -L "$c/interpreter" ] &&
     [ -O "$c/interpreter" ] && read -r p < "$c/interpreter" && [ -x "$p" ]; then
    if fleetctl_trust "$p" >/dev/null; then fleetctl_run "$p" || rm -f "$c/interpreter"; else rm -f "$c/interpreter"; fi
  fi
fi
if [ -z "$named" ]; then
  for n in python3 python; do
    q=$(command -v "$n") || continue
    case "$tried$nl" in *"$nl$q$nl"*) break;; esac
    why=$(fleetctl_trust "$q") || { @REFUSE@; }
    fleetctl_run "$q"; break
  done
fi
for f in $(grep -l -a -e sglang /proc/[0-9]*/cmdline 2>/dev/null); do
  e=$(readlink "${f%/cmdline}/exe" 2>/dev/null) || continue
  case ${e##*/} in python*) fleetctl_other "$e";; esac
done
for n in python3 python @FALLBACK@; do q=$(command -v "$n") && fleetctl_other "$q"; done
if [ -n "$old" ]; then
  @SAY@ "@TOO_OLD@" >&2
  exit @OLD@
fi
@SAY@ "no python3 or python on PATH, and no running SGLang server's interpreter or PATH's @RANGE@ either" >&2
exit 127'''
# the sentence a start with no interpreter new enough ends with ($old: "P is VERSION, ...")
_TOO_OLD = ("the probes need Python 3.8+; $old, and no other trusted Python 3.8+ was found (a running SGLang "
            "server's, PATH's @RANGE@); set ansible_python_interpreter to a Python 3.8+ interpreter on this host")
for _k, _v in {"@OLD@": str(TOO_OLD_EXIT), "@SAY@": "printf '\\n%s%s\\n' \"" + NO_PYTHON + '"', "@REFUSE@": _REFUSE,
               "@TOO_OLD@": _TOO_OLD, "@FALLBACK@": " ".join(FALLBACK_NAMES),
               "@RANGE@": f"{FALLBACK_NAMES[-1]} to {FALLBACK_NAMES[0]}"}.items():
    _START = _START.replace(_k, _v)


def command(python: str | None, guard: bool = True, options: Sequence[str] = (), fallback: bool = True) -> list[str]:
    """The argv that runs WRAPPER (every probe starts with `python -I -S`: no site, no
    PYTHON* variables, no working directory on sys.path) under `python` (with `options`, the
    inventory's interpreter options, after -I -S: Host.interpreter): through trust.GUARD when
    `guard` (a host, where the probe runs as root or the probing user: the interpreter and
    every directory its path resolves through checked by the same command that runs it; a
    name, not a path, is looked up on the host's PATH first, as `/usr/bin/env NAME` does; one
    older than 3.8 is passed over for another, see _START), directly when not (a container's
    own interpreter, entered with no more power than the container's process has:
    connection/container.py). None: the recorded interpreter or the first python3/python on
    PATH, each cleared by GUARD on this start, and the others of _START when those are too old.
    `fallback` False: `python` must run the probe itself (an install's interpreter, whose
    packages the probe uses), never another one."""
    if python and not guard:
        return [python, "-I", "-S", *options, "-c", WRAPPER]
    return ["sh", "-c", _START, WRAPPER, "any" if fallback or not python else "only", python or "", *options]


def which(name: str) -> list[str]:
    """The argv that prints the path interpreter name `name` (as the inventory gives it: no
    slash) resolves to on the host's PATH, as `command -v` finds it (exit 127, no output: none)."""
    return ["sh", "-c", 'command -v -- "$1"', "fleetctl-which", name]


def path_python(args: list[str]) -> list[str]:
    """The argv that runs python3 (else python) on PATH, cleared by trust.GUARD, as `python -I -S
    ARGS...` (connection/command.py container_entry's entry program); exit 126 with REFUSED on
    stderr when refused."""
    return ["sh", "-c", trust.GUARD + "\n" + _PATH_PYTHON, "fleetctl", *args]


class CutShort(ProbeError):
    """A probe's output held its result marker but no whole JSON text after it: the output ended
    early. `size`: bytes of the output received; `exit_code`: the command's; `tail`: the end of
    its stderr (what killed it may have said so)."""

    def __init__(self, message: str, size: int, exit_code: int, tail: str):
        super().__init__(message)
        self.size, self.exit_code, self.tail = size, exit_code, tail


class Untrusted(ProbeError):
    """trust.GUARD refused the interpreter a probe was to start under; the message is why."""


class NoPython(ProbeError):
    """No interpreter that can run the probes (Python 3.8+) was found, or the inventory's is not
    on the host's PATH; the message is the sentence the start printed (NO_PYTHON)."""


def parse_output(stdout: bytes, stderr: bytes, exit_code: int) -> dict:
    """Extract the probe's JSON result from its output.

    Raises Untrusted when trust.GUARD refused its interpreter, NoPython when no interpreter
    could run the probes (too old, or none: the start's own sentence), CutShort when the text
    after the marker is no whole JSON text, ProbeError when the probe crashed (its traceback
    included) or printed no result.
    """
    text = stdout.decode("utf-8", "replace")
    found = result.after_marker(text)
    if found is None:
        err = stderr.decode("utf-8", "replace")
        refused = err.rpartition("\n" + REFUSED)[2]
        if exit_code == 126 and refused:
            raise Untrusted(refused.strip()[:2000])
        _, said, why = err.rpartition("\n" + NO_PYTHON)
        if exit_code in (TOO_OLD_EXIT, 127) and said:
            raise NoPython(why.strip()[:2000])
        tail = (stderr.decode("utf-8", "replace") or text).strip()[-2000:]
        raise ProbeError(f"probe printed no result (exit {exit_code}): {tail or 'no output'}")
    try:
        out = json.loads(found)
    except ValueError as e:
        raise CutShort(f"probe result is not JSON (output cut short?): {e}", len(stdout), exit_code,
                       stderr.decode("utf-8", "replace").strip()[-500:]) from None
    if isinstance(out, dict) and "__probe_error__" in out:
        raise ProbeError("probe failed on the host:\n" + out["__probe_error__"].strip())
    return out
