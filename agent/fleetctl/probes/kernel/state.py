"""The kbuild probe's state and mark actions (stdlib only, Python 3.8+): a kernel package's build
on the host as it is (the `current` link's target, whether the build passed and is published,
the dispatch table's bytes, whether the install has the route hook), and the record that a build
passed its reference test (BUILD_DIR/PASSED)."""

from __future__ import annotations

import hashlib
import os
import stat

from .. import safefs
from . import publish


def state(params: dict) -> dict:
    """params: {link: the package's `current` symlink, build_dir: a build's private directory;
    optional: public_dir (the build's published directory PUBLIC/NAME/<key>), table (the
    package's PUBLIC/NAME/dispatch.json), hook (the install's
    sglang/srt/layers/attention/fleetctl_verify.py, or None)}.
    Returns {"current": the link's target or None, "passed": whether build_dir/PASSED exists},
    and for each optional param given: "published" (public_dir/PASSED is a regular file),
    "table" (None when absent; {"sha256", "text"} of the file read without following a link,
    at most TABLE_MAX_BYTES; {"error": why} when it is a link, not a regular file, too big or
    not UTF-8), "hooked" (the hook module is a file there)."""
    try:
        current = os.readlink(params["link"])
    except OSError:
        current = None
    out = {"current": current or None, "passed": os.path.isfile(os.path.join(params["build_dir"], "PASSED"))}
    if params.get("public_dir"):
        try:
            out["published"] = stat.S_ISREG(os.lstat(os.path.join(params["public_dir"], "PASSED")).st_mode)
        except OSError:
            out["published"] = False
    if "table" in params:
        out["table"] = _read_table(params["table"])
    if "hook" in params:
        out["hooked"] = bool(params["hook"]) and os.path.isfile(params["hook"])
    return out


TABLE_MAX_BYTES = 64 << 10


def _read_table(path: str):
    """The dispatch table file at `path` for state(): None, {"sha256", "text"} or {"error"}
    (read from / without following a link: safefs.read_file)."""
    try:
        data = safefs.read_file(path, TABLE_MAX_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, safefs.UnsafePath) as e:
        return {"error": str(e)}
    try:
        return {"sha256": hashlib.sha256(data).hexdigest(), "text": data.decode("utf-8")}
    except UnicodeDecodeError:
        return {"error": "%s: not UTF-8" % path}


def mark(params: dict) -> dict:
    """params: {build_dir, module_path; public_dir, public_module: the build's published copy,
    tested there (optional)}. Write build_dir/PASSED (the module path) atomically, and
    public_dir/PASSED (the published module path; publish.write_passed: O_EXCL, root's 0644),
    public_dir reached from / without following a link. Returns {"ok": true}."""
    if params.get("public_dir"):
        dfd = safefs.open_dir(params["public_dir"])
        try:
            if safefs.lstat(dfd, "PASSED") is None:
                publish.write_passed(dfd, params["public_module"])
        finally:
            os.close(dfd)
    path = os.path.join(params["build_dir"], "PASSED")
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "w") as f:
        f.write(params["module_path"] + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"ok": True}
