"""Whether root may run an interpreter (review M6, N7, N10): the rule, and its two checks.

Stdlib only (Python 3.8+). Everything an interpreter runs when it starts must belong to root
(or the probing user) and be writable by nobody else, and so must every directory above it up
to `/`: who can write a directory can replace what is in it, so a root-owned venv under a
directory another user owns is theirs to swap (a directory writable by others passes only when
it is root's and sticky, as /tmp: nobody can replace another's entry there).

- `untrusted(python)`, in Python, for an interpreter started with its site module (the facts
  probe asking an install's interpreter, the kernel build): the interpreter, its bin/ directory,
  prefix and pyvenv.cfg, and each site directory with its `.pth`, sitecustomize and
  usercustomize files (site.py executes `.pth` import lines at start), each with its ancestors.
- `GUARD`, in POSIX sh (probes.command), for every probe's start with `python -S` (no site):
  the interpreter as named and as resolved, pyvenv.cfg and every ancestor directory, checked by
  `stat` in the same command that then execs it, never cached: what the check saw is what runs,
  since only root (or this user) could change it in between. tests/machine/test_trust_rule.py
  checks the two agree on the same trees.
"""

import glob
import os


def _ancestors(path):
    """`path`'s directories above it, up to and including /."""
    out = []
    while True:
        up = os.path.dirname(path)
        if up == path:
            return out
        out.append(up)
        path = up


def _judge(path, st, euid):
    """Why `st` (os.stat of `path`) makes it unsafe for root to run, or None."""
    if st.st_uid not in (0, euid):
        return "%s belongs to uid %d" % (path, st.st_uid)
    if st.st_mode & 0o022 and not (st.st_uid == 0 and st.st_mode & 0o1000 and os.path.isdir(path)):
        return "%s is writable by group or others" % path
    return None


def start_paths(python):
    """What starting `python -S` depends on ([path]: the interpreter as named and as resolved,
    a pyvenv.cfg beside it or in its prefix when there is one (CPython's getpath looks in both:
    its `home` picks the standard library), and every ancestor directory of each), in the
    order GUARD checks them."""
    real = os.path.realpath(python)
    paths = [python, real]
    for d in (os.path.dirname(python), os.path.dirname(os.path.dirname(python))):
        if os.path.lexists(os.path.join(d, "pyvenv.cfg")):
            paths.append(os.path.join(d, "pyvenv.cfg"))
    for p in (python, real):
        paths += [d for d in _ancestors(p) if d not in paths]
    return paths


def untrusted(python, site=True):
    """Why `python` (an absolute path) must not be run as root by fleetctl, or None: see the
    module docstring; `site`: also what its site module runs (False: only what `python -S`
    runs, GUARD's rule). Follows symlinks as the interpreter's start does (os.stat), and checks
    the link's directory too (an ancestor)."""
    if not os.path.isabs(python):
        return "%s is not an absolute path" % python
    paths = start_paths(python)
    if site:
        for d in site_dirs(python):
            found = [d] + sorted(glob.glob(os.path.join(glob.escape(d), "*.pth")))
            found += [p for p in (os.path.join(d, n) for n in ("sitecustomize.py", "usercustomize.py"))
                      if os.path.lexists(p)]
            paths += [p for p in found + _ancestors(d) if p not in paths]
    euid = os.geteuid()
    for path in paths:
        try:
            st = os.stat(path)
        except OSError as e:
            return "cannot stat %s: %s" % (path, e.strerror)
        why = _judge(path, st, euid)
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
# `fleetctl_trust PATH` prints why PATH must not be run as root and returns 1, or returns 0
# (start_paths's paths, each stat'ed: owner root or this user, no group/other write unless root's
# and sticky; a path with a newline is refused, since stat's lines are read one per path). Needs
# readlink -f and stat -L -c (coreutils, busybox).
GUARD = r'''fleetctl_trust() (
  case $1 in /*) ;; *) echo "$1 is not an absolute path"; exit 1;; esac
  case $1 in *"
"*) echo "the interpreter path holds a newline"; exit 1;; esac
  r=$(readlink -f -- "$1") || { echo "cannot resolve $1"; exit 1; }
  set -- "$1" "$r"
  for c in "${1%/*}/pyvenv.cfg" "${1%/*/*}/pyvenv.cfg"; do
    if [ -e "$c" ] || [ -L "$c" ]; then set -- "$@" "$c"; fi
  done
  for x in "$1" "$r"; do
    while [ -n "$x" ] && [ "$x" != / ]; do x=${x%/*}; [ -n "$x" ] || x=/; set -- "$@" "$x"; done
  done
  me=$(id -u)
  out=$(stat -L -c '%u %a %F|%n' -- "$@" 2>&1) || { echo "cannot stat: $out" | head -n 1; exit 1; }
  printf '%s\n' "$out" | while read -r u m rest; do
    n=${rest#*|}; t=${rest%%|*}
    if [ "$u" != 0 ] && [ "$u" != "$me" ]; then echo "$n belongs to uid $u"; exit 1; fi
    if [ $(( 0$m & 022 )) != 0 ] && ! { [ "$u" = 0 ] && [ $(( 0$m & 01000 )) != 0 ] && [ "$t" = directory ]; }; then
      echo "$n is writable by group or others"; exit 1; fi
  done
)'''
