"""Remote probe: which files of an SGLang checkout git sees modified, git run as the tree's owner.

Stdlib only (Python 3.8+). A checkout (an editable install or a tree found through a server's
working directory) may be a git work tree; `status` then asks git which tracked files under
`sglang/` differ from the index. git reads the repository's own config, and `core.fsmonitor`
(and hooks) there are commands it runs: so git never runs as root with it. It runs as the owner
of the work tree (setgid/setuid in the child when this probe is root), with `core.fsmonitor`
and `core.hooksPath` overridden on the command line all the same; a tree owned by root is only
read with those overrides. A tree without `.git` is not a git work tree (the ledger alone judges
it). Paths from git are NUL-separated and bounded; none is followed.
"""

import os
import pwd
import subprocess

GIT_TIMEOUT_S = 60
MAX_PATHS = 10000


def work_tree(location):
    """The git work tree holding directory `location` (the nearest parent with `.git`), else None."""
    d = os.path.realpath(location)
    while True:
        if os.path.exists(os.path.join(d, ".git")):
            return d
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def _as(uid, gid):
    def drop():
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    return drop


def modified(location):
    """{"git": work tree or None, "modified": [absolute paths of tracked files under
    <location>/sglang that git sees changed], "error": str or None}."""
    tree = work_tree(location)
    if tree is None:
        return {"git": None, "modified": [], "error": None}
    st = os.stat(tree)
    if st.st_uid != os.geteuid() and os.geteuid() != 0:
        return {"git": tree, "modified": [], "error": "cannot run git as uid %d (the tree's owner)" % st.st_uid}
    try:
        home = pwd.getpwuid(st.st_uid).pw_dir
    except KeyError:
        home = "/nonexistent"
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"}
    pkg = os.path.join(os.path.realpath(location), "sglang")
    argv = ["git", "-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null", "-C", tree,
            "status", "--porcelain=v1", "-z", "--untracked-files=no", "--", pkg]
    pre = _as(st.st_uid, st.st_gid) if os.geteuid() == 0 and st.st_uid != 0 else None
    try:
        r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd="/",
                           preexec_fn=pre, timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"git": tree, "modified": [], "error": "git: %s" % e}
    if r.returncode != 0:
        return {"git": tree, "modified": [], "error": "git status failed (exit %d): %s"
                % (r.returncode, r.stderr.decode("utf-8", "replace").strip()[-300:])}
    out, items = [], r.stdout.split(b"\0")
    i = 0
    while i < len(items) and len(out) < MAX_PATHS:
        item = items[i]
        i += 1
        if len(item) < 4:
            continue
        code, path = item[:2].decode("ascii", "replace"), item[3:].decode("utf-8", "replace")
        if code[0] in "RC":
            i += 1  # a rename's source path follows
        out.append(os.path.join(tree, path))
    return {"git": tree, "modified": sorted(out), "error": None}


def main(params):
    """params {"locations": [dir]} -> {"ok": True, "trees": {location: modified(location)}}."""
    return {"ok": True, "trees": dict((loc, modified(loc)) for loc in params["locations"])}
