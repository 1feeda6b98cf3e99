"""Whether root may run an interpreter with `-I -S` (review M6, N7, N10): the rule, and its two checks.

Stdlib only (Python 3.8+). Root starts an interpreter only without its site module (every probe:
`python -I -S`), and only when everything that start reads belongs to root (or the probing user)
and is writable by nobody else, and so is every directory above it up to `/`: who can write a
directory can replace what is in it, so a root-owned venv under a directory another user owns is
theirs to swap (a directory writable by others passes only when it is root's and sticky, as
/tmp: nobody can replace another's entry there). What an install's site module runs (`.pth`
lines, sitecustomize, finders) and its packages are never judged here: they run only as an
unprivileged uid (runas.py, issue 48), which made the site-file and import-tree walks of
earlier rounds (untrusted(site=True), untrusted_imports) redundant; they are gone.

- `untrusted(python)`, in Python (the facts probe inside a container, the interpreter record of
  scancache).
- `GUARD`, in POSIX sh (probes.command), for every probe's start: the interpreter as named and
  as resolved, pyvenv.cfg and every ancestor directory, checked by `stat` in the same command
  that then execs it, never cached: what the check saw is what runs, since only root (or this
  user) could change it in between. tests/machine/test_trust_rule.py checks the two agree on
  the same trees.
"""

import glob
import os


class _Refused(Exception):
    """Why an interpreter's path cannot be judged (a link loop, a line break)."""


def _walk(path, consulted):
    """The path `path` resolves to, hop by hop as the kernel resolves it (every link of every
    component followed, 40 at most: path_resolution(7)), appending to `consulted` each
    directory an entry was looked up in, in order. Raises _Refused, OSError."""
    out, rest, hops = "/", [c for c in path.split("/") if c], 0
    while rest:
        comp = rest.pop(0)
        if comp == ".":
            continue
        if comp == "..":
            out = os.path.dirname(out)
            continue
        consulted.append(out)
        nxt = os.path.join(out, comp)
        if os.path.islink(nxt):
            hops += 1
            if hops > 40:
                raise _Refused("too many links resolving %s" % path)
            target = os.readlink(nxt)
            if "\n" in target:
                raise _Refused("the link %s holds a newline" % nxt)
            if target.startswith("/"):
                out = "/"
            rest[:0] = [c for c in target.split("/") if c]
        else:
            out = nxt
    return out


def _judge(path, st, euid, sticky_ok):
    """Why `st` (os.stat of `path`) makes it unsafe for root to run, or None; `sticky_ok`: a
    directory others can write passes when it is root's and sticky."""
    if st.st_uid not in (0, euid):
        return "%s belongs to uid %d" % (path, st.st_uid)
    if st.st_mode & 0o022 and not (sticky_ok and st.st_uid == 0 and st.st_mode & 0o1000 and os.path.isdir(path)):
        return "%s is writable by group or others" % path
    return None


def _home(cfg):
    """The `home` key of pyvenv.cfg text `cfg` (venv(7)), or None."""
    for line in (cfg or "").splitlines():
        k, sep, v = line.partition("=")
        if sep and k.strip() == "home":
            return v.strip() or None
    return None


def start_paths(python):
    """What starting `python -I -S` depends on, in the order GUARD checks it: (paths, strict).
    paths: every directory consulted resolving the interpreter's path (each link of each
    component: review round 3), the interpreter, a pyvenv.cfg beside it or in its prefix
    (CPython's getpath reads both: its `home` picks the standard library, whose path is then
    resolved too), and the standard library's directories under each prefix (lib and lib64:
    python3.*, their encodings/ and lib-dynload/, python3*.zip). strict: the directories
    getpath looks for names in (the interpreter's directory and prefix, as named and as
    resolved, home's, lib/, python3.*/): no sticky exception there, since a name not there yet
    could be created by anyone. Raises _Refused, OSError."""
    paths, strict = [], []
    real = _walk(python, paths)
    named = _walk(os.path.dirname(python), paths)
    paths.append(real)
    bindir = os.path.dirname(real)
    strict += [named, os.path.dirname(named), bindir, os.path.dirname(bindir)]
    prefixes = [os.path.dirname(named), os.path.dirname(bindir)]
    home = None
    for cfg in (os.path.join(named, "pyvenv.cfg"), os.path.join(os.path.dirname(named), "pyvenv.cfg")):
        if os.path.lexists(cfg):
            paths.append(cfg)
            home = home or _home(_read(cfg))
    if home:
        h = _walk(home, paths)
        strict += [h, os.path.dirname(h)]
        prefixes.append(os.path.dirname(h))
    for p in prefixes:
        for lib in (os.path.join(p, "lib"), os.path.join(p, "lib64")):
            if not os.path.isdir(lib):
                continue
            strict.append(lib)
            for d in sorted(glob.glob(os.path.join(glob.escape(lib), "python3*"))):
                d = _walk(d, paths)
                (strict if os.path.isdir(d) else paths).append(d)
                paths += [os.path.join(d, n) for n in ("encodings", "lib-dynload") if os.path.isdir(os.path.join(d, n))]
    return paths, strict


def untrusted(python):
    """Why `python` (an absolute path) must not be run as root by fleetctl with `-I -S`, or None:
    see the module docstring and start_paths (GUARD's rule, in Python)."""
    if not os.path.isabs(python):
        return "%s is not an absolute path" % python
    if "\n" in python:
        return "the interpreter path holds a newline"
    try:
        paths, strict = start_paths(python)
    except _Refused as e:
        return str(e)
    except OSError as e:
        return "cannot resolve %s: %s" % (python, e.strerror)
    euid = os.geteuid()
    for group, sticky_ok in ((paths, True), (strict, False)):
        for path in group:
            try:
                st = os.stat(path)
            except OSError as e:
                return "cannot stat %s: %s" % (path, e.strerror)
            why = _judge(path, st, euid, sticky_ok)
            if why:
                return why
    return None


def site_dirs(python):
    """Site directories of interpreter path `python`, from its layout and pyvenv.cfg (a venv that
    includes system site packages adds its base's)."""
    prefix = os.path.dirname(os.path.dirname(python))
    pats = ["lib/python3*/site-packages", "lib/python3*/dist-packages", "local/lib/python3*/dist-packages"]
    dirs = [d for p in pats for d in sorted(glob.glob(os.path.join(prefix, p)))]
    cfg = _read(os.path.join(prefix, "pyvenv.cfg")) or ""
    conf = dict((k.strip(), v.strip()) for k, sep, v in (line.partition("=") for line in cfg.splitlines()) if sep)
    if conf.get("include-system-site-packages", "false").lower() == "true" and conf.get("home"):
        base = os.path.dirname(conf["home"])
        dirs += [d for p in pats for d in sorted(glob.glob(os.path.join(base, p)))]
    if prefix == "/usr" or os.path.dirname(conf.get("home", "")) == "/usr":
        dirs.append("/usr/lib/python3/dist-packages")
    return dirs


def _read(path):
    try:
        with open(path) as f:
            return f.read(1 << 16)
    except (OSError, ValueError):
        return None


# The POSIX sh function GUARD's callers use (a subshell: it sets none of the caller's variables):
# `fleetctl_trust PATH` prints why PATH must not be run as root and returns 1, or returns 0. The
# same paths as start_paths, in the same order, stat'ed twice (paths, then strict: owner root or
# this user, no group/other write, unless root's and sticky for `paths`); a path or link with a
# newline is refused, since the lists are one path a line. Needs readlink and stat -L -c
# (coreutils, busybox) and sed.
GUARD = r'''fleetctl_trust() (
  nl='
'
  case $1 in /*) ;; *) echo "$1 is not an absolute path"; exit 1;; esac
  case $1 in *"$nl"*) echo "the interpreter path holds a newline"; exit 1;; esac
  n=0; paths=; strict=
  up() { u=${1%/*}; [ -n "$u" ] || u=/; }
  walk() {
    out=/; rest=${1#/}
    while [ -n "$rest" ]; do
      case $rest in */*) comp=${rest%%/*}; rest=${rest#*/};; *) comp=$rest; rest=;; esac
      case $comp in "") continue;; .) continue;; ..) up "$out"; out=$u; continue;; esac
      paths="$paths$nl$out"
      next=${out%/}/$comp
      if [ -L "$next" ]; then
        n=$((n + 1)); [ "$n" -le 40 ] || { echo "too many links resolving $1"; exit 1; }
        t=$(readlink -- "$next") || { echo "cannot resolve $1: cannot read $next"; exit 1; }
        case $t in *"$nl"*) echo "the link $next holds a newline"; exit 1;; esac
        case $t in /*) out=/; rest=${t#/}${rest:+/$rest};; *) rest=$t${rest:+/$rest};; esac
      else out=$next; fi
    done
    r=$out
  }
  walk "$1"; real=$r
  up "$1"; walk "$u"; named=$r
  paths="$paths$nl$real"
  up "$real"; bindir=$u
  up "$named"; np=$u; up "$bindir"; bp=$u
  strict="$named$nl$np$nl$bindir$nl$bp"
  prefixes="$np$nl$bp"
  home=
  for c in "${named%/}/pyvenv.cfg" "${np%/}/pyvenv.cfg"; do
    if [ -e "$c" ] || [ -L "$c" ]; then
      paths="$paths$nl$c"
      [ -n "$home" ] || home=$(sed -n 's/^[[:space:]]*home[[:space:]]*=[[:space:]]*//p' "$c" | head -n 1 | sed 's/[[:space:]]*$//')
    fi
  done
  if [ -n "$home" ]; then walk "$home"; up "$r"; strict="$strict$nl$r$nl$u"; prefixes="$prefixes$nl$u"; fi
  set -f; IFS=$nl
  for p in $prefixes; do
    for lib in "${p%/}/lib" "${p%/}/lib64"; do
      [ -d "$lib" ] || continue
      strict="$strict$nl$lib"
      set +f
      for d in "$lib"/python3*; do
        [ -e "$d" ] || [ -L "$d" ] || continue
        walk "$d"; d=$r
        if [ -d "$d" ]; then strict="$strict$nl$d"; else paths="$paths$nl$d"; fi
        for x in encodings lib-dynload; do [ -d "$d/$x" ] && paths="$paths$nl$d/$x"; done
      done
      set -f
    done
  done
  me=$(id -u)
  for group in paths strict; do
    eval "list=\$$group"
    set -- $list
    out=$(stat -L -c '%u %a %F|%n' -- "$@" 2>&1) || { echo "cannot stat: $out" | head -n 1; exit 1; }
    printf '%s\n' "$out" | while IFS=' ' read -r u m rest; do
      nm=${rest#*|}; t=${rest%%|*}
      if [ "$u" != 0 ] && [ "$u" != "$me" ]; then echo "$nm belongs to uid $u"; exit 1; fi
      if [ $(( 0$m & 022 )) != 0 ] && ! { [ "$group" = paths ] && [ "$u" = 0 ] && [ $(( 0$m & 01000 )) != 0 ] && [ "$t" = directory ]; }; then
        echo "$nm is writable by group or others"; exit 1; fi
    done || exit 1
  done
)'''
