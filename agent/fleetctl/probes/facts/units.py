"""Remote probe helper: the systemd services that run SGLang, and the interpreter each one starts.

Stdlib only (Python 3.8+), loaded by the facts probe bundle. A service is found by its unit file
(systemd.unit(5) search path: /etc/systemd/system, /run/systemd/system, /usr/local/lib/systemd/
system, /lib/systemd/system, /usr/lib/systemd/system; the first file of a name wins, and its
drop-ins `NAME.service.d/*.conf` of every directory apply in file-name order) whose text, or a
drop-in's, names `sglang`. What the service runs is what systemd says
(`systemctl show -p Id,ExecStart,WorkingDirectory,User,Environment` when systemd is the running
init, sd_booted(3): /run/systemd/system exists), else what the unit files say, read here
(systemd.service(5) ExecStart=, systemd.exec(5) WorkingDirectory=, User=, Environment=). Nothing
a unit names is run here: each interpreter is handed to the facts probe, which asks it as an
unprivileged uid (runas). Strings from the host are bounded (MAX_UNIT_BYTES, procs.MAX_ARG).
"""

import glob
import os
import shlex
import shutil
import stat

from . import procs
from .. import bounded

SEARCH_PATH = ("/etc/systemd/system", "/run/systemd/system", "/usr/local/lib/systemd/system",
               "/lib/systemd/system", "/usr/lib/systemd/system")
PROPERTIES = ("Id", "ExecStart", "WorkingDirectory", "User", "Environment")
SHOW_TIMEOUT_S = 10
MAX_UNIT_BYTES = 1 << 16  # a unit file or drop-in read (a real one has a few hundred bytes)
MAX_UNITS = 64  # units naming sglang that are read (the rest are left out)
_SHELLS = ("sh", "bash", "dash")


def read_unit(path):
    """The text of unit file `path` (a regular file, opened without blocking: never a FIFO or a
    device), up to MAX_UNIT_BYTES; None when it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, MAX_UNIT_BYTES).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def unit_files(search=SEARCH_PATH):
    """{service name: [paths]}: for each `*.service` of the search path (no template
    `NAME@.service`), its unit file (the first directory holding the name wins) and then its
    drop-ins (`NAME.service.d/*.conf` of every directory; one name in an earlier directory hides
    the same name in later ones), in file-name order (systemd.unit(5))."""
    found, seen = {}, set()
    for d in search:
        real = os.path.realpath(d)
        if real in seen:  # /lib -> /usr/lib
            continue
        seen.add(real)
        for path in sorted(glob.glob(os.path.join(glob.escape(d), "*.service"))):
            name = os.path.basename(path)
            if "@." not in name:
                found.setdefault(name, [path])
    out = {}
    for name, main in found.items():
        drops = {}
        for d in search:
            for path in sorted(glob.glob(os.path.join(glob.escape(d), glob.escape(name) + ".d", "*.conf"))):
                drops.setdefault(os.path.basename(path), path)
        out[name] = main + [drops[k] for k in sorted(drops)]
    return out


def _logical_lines(text):
    """Lines of a unit file with comments dropped and backslash continuations joined."""
    out, cur = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not cur and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    if cur:
        out.append(cur)
    return out


def _split(value):
    """The words of a unit-file command line or assignment list (quoted as systemd.syntax(7),
    close to a shell's), or None when its quoting is broken."""
    try:
        return shlex.split(value.replace("%%", "%"))
    except ValueError:
        return None


def _exec_argv(value):
    """argv of one ExecStart= value (systemd.service(5)): its prefixes `@-:+!` dropped; with `@`,
    the first word is the program and the second its argv[0], which this gives as the program."""
    i = 0
    while i < len(value) and value[i] in "@-:+!":
        i += 1
    words = _split(value[i:])
    if not words:
        return None
    if "@" in value[:i]:
        words = words[:1] + words[2:]
    return [w[:procs.MAX_ARG] for w in words]


def _environment(words):
    """{name: value} of Environment= words ("A=b" each)."""
    env = {}
    for w in words or []:
        k, sep, v = w.partition("=")
        if sep and k:
            env[k] = v[:procs.MAX_ARG]
    return env


def parse_unit(texts):
    """The [Service] settings of a unit file and its drop-ins (`texts`, in order): {"exec_start":
    [argv], "cwd": WorkingDirectory (its `-` prefix dropped; `~` kept) or None, "user": User= or
    None, "environment": {name: value}}. An empty ExecStart= or Environment= resets what came
    before it, as systemd does for drop-ins."""
    out = {"exec_start": [], "cwd": None, "user": None, "environment": {}}
    for text in texts:
        section = None
        for line in _logical_lines(text):
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1]
                continue
            key, sep, value = line.partition("=")
            if section != "Service" or not sep:
                continue
            key, value = key.strip(), value.strip()
            if key == "ExecStart":
                argv = _exec_argv(value) if value else None
                if not value:
                    out["exec_start"] = []
                elif argv:
                    out["exec_start"].append(argv)
            elif key == "WorkingDirectory":
                out["cwd"] = value.lstrip("-")[:procs.MAX_ARG] or None
            elif key == "User":
                out["user"] = value[:procs.MAX_ARG] or None
            elif key == "Environment":
                if not value:
                    out["environment"] = {}
                else:
                    out["environment"].update(_environment(_split(value)))
    return out


def _show_exec(value):
    """argv of one ExecStart= line of `systemctl show` ("{ path=P ; argv[]=A B ; ignore_errors=no
    ; ... }": systemctl joins argv with spaces, unquoted), with the program P systemd resolved as
    argv[0]; None when it says something else."""
    value = value.strip()
    if not (value.startswith("{") and value.endswith("}")):
        return None
    fields = dict(f.strip().partition("=")[::2] for f in value[1:-1].split(" ; "))
    words = fields.get("argv[]", "").split()
    path = fields.get("path")
    if not words or not path or path == "n/a":
        return None
    return [w[:procs.MAX_ARG] for w in [path] + words[1:]]


def parse_show(text):
    """The units of `systemctl show -p Id,ExecStart,WorkingDirectory,User,Environment UNIT...`
    output (blocks of KEY=VALUE lines, one block per unit, separated by a blank line): [{"unit",
    "exec_start": [argv], "cwd" (systemd's `!` prefix dropped), "user", "environment"}]."""
    out = []
    for block in text.split("\n\n"):
        unit = {"unit": None, "exec_start": [], "cwd": None, "user": None, "environment": {}}
        for line in block.splitlines():
            key, sep, value = line.partition("=")
            if not sep:
                continue
            if key == "Id":
                unit["unit"] = value.strip()[:procs.MAX_ARG] or None
            elif key == "ExecStart":
                argv = _show_exec(value)
                if argv:
                    unit["exec_start"].append(argv)
            elif key == "WorkingDirectory":
                unit["cwd"] = value.strip().lstrip("!")[:procs.MAX_ARG] or None
            elif key == "User":
                unit["user"] = value.strip()[:procs.MAX_ARG] or None
            elif key == "Environment":
                unit["environment"] = _environment(_split(value) or value.split())
        if unit["unit"]:
            out.append(unit)
    return out


def _home(user):
    try:
        import pwd
        return pwd.getpwnam(user).pw_dir
    except (ImportError, KeyError):
        return None


def _shebang(path):
    """The interpreter a script's `#!` line names (its first word), or None."""
    head = read_unit(path) or ""
    if not head.startswith("#!"):
        return None
    words = head[2:].split("\n", 1)[0].split()
    return words[0] if words else None


def server_python(argv, cwd=None, depth=0):
    """(interpreter, its argv from the interpreter on) of the SGLang server a service command
    line `argv` starts: a python whose program is SGLang's (procs.server_kind), anywhere in the
    line (after a launcher: `uv run`, `conda run`, `env`, `timeout`...), or `.../sglang serve`
    (the console script: its `#!` interpreter), or either inside `sh -c "..."`; a bare `python`
    is taken from the working directory's `.venv` (what `uv run` runs). None when it starts no
    SGLang server that can be read from the line."""
    for i, word in enumerate(argv):
        base = os.path.basename(word)
        rest = argv[i:]
        if base.startswith("python") and procs.server_kind(rest):
            if not word.startswith("/"):
                word = os.path.join(cwd, ".venv", "bin", word) if cwd else None
            return (word, rest) if word else None
        if base == "sglang" and argv[i + 1:i + 2] == ["serve"] and word.startswith("/"):
            py = _shebang(word)
            return (py, [py] + rest) if py and py.startswith("/") else None
        if base in _SHELLS and argv[i + 1:i + 2] == ["-c"] and i + 2 < len(argv) and depth < 2:
            inner = _split(argv[i + 2])
            return server_python(inner, cwd, depth + 1) if inner else None
    return None


def show_argv(systemctl, names):
    """The command line asking `systemctl` (its path) for PROPERTIES of the services `names`."""
    return [systemctl, "show", "--no-pager"] + ["-p" + p for p in PROPERTIES] + ["--"] + names


def _show(names, systemctl):
    """parse_show of `systemctl show` for service `names` (`systemctl`: see services), or None
    when there is none to ask, or it fails or does not answer within SHOW_TIMEOUT_S (bounded.run:
    a stuck one is left behind; the unit files are read instead)."""
    if systemctl is None:
        systemctl = shutil.which("systemctl") if os.path.isdir("/run/systemd/system") else None
    if not names or not systemctl:
        return None
    try:
        r = bounded.run(show_argv(systemctl, names), SHOW_TIMEOUT_S)
    except OSError:
        return None
    return parse_show(r.stdout[:1 << 22]) if r.returncode == 0 else None


def services(search=SEARCH_PATH, systemctl=None):
    """The services whose unit files (in the directories `search`) name sglang, with the SGLang
    server each starts, as `systemctl` says (its path; None: the one on PATH when systemd is the
    running init, sd_booted(3); False: none, the unit files are read here):
    [{"unit", "source": "systemctl" or the unit file's path, "python", "argv" (from the
    interpreter on), "cwd" (`~` made User='s home), "user", "pythonpath": [entries of its
    Environment= PYTHONPATH]}], one per ExecStart= that starts one (server_python)."""
    files = unit_files(search)
    named = {}
    for name in sorted(files):
        texts = [read_unit(p) or "" for p in files[name]]
        if any("sglang" in t.lower() for t in texts):
            named[name] = texts
        if len(named) >= MAX_UNITS:
            break
    shown = _show(sorted(named), systemctl)
    if shown is not None:
        units = [dict(u, source="systemctl") for u in shown if u["unit"] in named]
    else:
        units = [dict(parse_unit(texts), unit=name, source=files[name][0]) for name, texts in named.items()]
    out = []
    for u in units:
        cwd = u["cwd"]
        if cwd and cwd.startswith("~"):
            home = _home(u["user"] or "root")
            cwd = (home + cwd[1:]) if home else None
        for argv in u["exec_start"]:
            found = server_python(argv, cwd)
            if not found:
                continue
            pp = [p for p in u["environment"].get("PYTHONPATH", "").split(":") if p]
            out.append({"unit": u["unit"], "source": u["source"], "python": found[0], "argv": found[1],
                        "cwd": cwd, "user": u["user"], "pythonpath": pp})
    return out


def import_path(unit):
    """The entries the server of service `unit` (a services() entry) starts with first on
    sys.path: as procs.import_path reads a running process, from the unit's working directory
    (the service's `/`, systemd's default, without one) and PYTHONPATH."""
    flags, kind, target, _ = procs.python_program(unit["argv"])
    cwd = unit["cwd"] or "/"
    entries = []
    if "I" not in flags and "P" not in flags:
        if kind in ("m", "c"):
            entries.append(cwd)
        elif kind == "script" and target:
            entries.append(os.path.dirname(os.path.join(cwd, target)))
    if "I" not in flags and "E" not in flags:
        entries += [os.path.join(cwd, p) for p in unit["pythonpath"]]
    return entries
