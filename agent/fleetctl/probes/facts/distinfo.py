"""Which of a distribution's dist-info directories in a site directory describes the files that
are there: the one whose RECORD (PEP 376 / PEP 627) matches the package's own files on disk.

Stdlib only (Python 3.8+), loaded by the facts and change probe bundles. An interrupted upgrade
or uninstall leaves a second `NAME-VERSION.dist-info` beside the current one, and a failed
install can leave one that holds only `REQUESTED` (python/importlib_metadata#291, #457,
python/cpython#100666): importlib.metadata then answers from whichever directory the file system
lists first (ext4: hash order; tmpfs: newest first), so its version, and its RECORD, can belong
to no file that imports. Here every candidate is judged by its RECORD's sha256 of the package's
version modules and `__init__.py` (KEY_FILES: the files that say which release this is and what
`import NAME` runs), whatever the listing order; the others are named in a warning as stale.
"""

import base64
import hashlib
import os
import re
import stat

from .. import safefs

# the package files a RECORD is matched on: the release's own version modules (version.py, and the
# _version.py setuptools-scm / vcs-versioning writes, which sglang 0.5.10's and 0.5.23's version.py
# import) and the package's entry point (in every wheel of sglang and torch)
KEY_FILES = ("version.py", "_version.py", "__init__.py")
# where a release says its version: a string constant `__version__` at the top of one of these
VERSION_MODULES = ("version.py", "_version.py")


def norm(name):
    """A distribution name as PEP 503 normalises it (`Foo_Bar.baz` -> `foo-bar-baz`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def dist_infos(site, name):
    """Sorted real paths of the `NAME-VERSION.dist-info` directories of distribution `name` in
    `site` ([] when it cannot be listed); the name part is what precedes the first `-`
    (PEP 427 escapes `-` in names as `_`)."""
    try:
        entries = os.listdir(site)
    except OSError:
        return []
    return sorted(os.path.realpath(os.path.join(site, e)) for e in entries if e.endswith(".dist-info")
                  and norm(e[:-len(".dist-info")].split("-", 1)[0]) == norm(name)
                  and os.path.isdir(os.path.join(site, e)))


def _bytes(path, limit):
    """The bytes of regular file `path` (its real path opened with O_NOFOLLOW|O_NONBLOCK: never
    through a link, never blocking on a FIFO; only search permission is needed on the way, as
    for any reader of an install's files: /root is 0711 on lab hosts). Raises OSError (missing:
    FileNotFoundError), ValueError ("not a regular file", "over LIMIT bytes": never read)."""
    fd = os.open(os.path.realpath(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError("over %d bytes" % limit)
    return data


def _read(path, limit=16 << 20):
    """Text of regular file `path` (_bytes), or None."""
    try:
        return _bytes(path, limit).decode("utf-8", "replace")
    except (OSError, ValueError):
        return None


def metadata_version(dist):
    """The `Version:` header of dist-info `dist`'s METADATA, None when it has none."""
    text = _read(os.path.join(dist, "METADATA"))
    for line in (text or "").splitlines():
        if not line.strip():
            break  # the headers end at the first blank line
        if line.lower().startswith("version:"):
            return line.split(":", 1)[1].strip() or None
    return None


def record(dist):
    """{path relative to the site: urlsafe-b64 sha256 or None} of dist-info `dist`'s RECORD;
    None when it has no RECORD."""
    text = _read(os.path.join(dist, "RECORD"))
    if text is None:
        return None
    out = {}
    for line in text.splitlines():
        parts = line.rsplit(",", 2)
        if len(parts) == 3:
            algo, _, value = parts[1].partition("=")
            out[parts[0].strip('"')] = value if algo == "sha256" and value else None
    return out


def _sha256s(paths):
    """{path: hex sha256 of its bytes (_bytes), None when missing, "<why>" when not read}: what
    judge hashes with when given no cache (drift passes its cache, whose hashes are safefs's)."""
    out = {}
    for p in paths:
        try:
            out[p] = hashlib.sha256(_bytes(p, safefs.MAX_FILE_BYTES)).hexdigest()
        except FileNotFoundError:
            out[p] = None
        except (OSError, ValueError) as e:
            out[p] = "<%s: %s>" % (p, e)
    return out


def b64(hexdigest):
    """The RECORD form (urlsafe b64, no padding) of a hex sha256; None and "<why>" (a file not
    read: safefs.sha256_file) as they are."""
    if hexdigest is None or hexdigest.startswith("<"):
        return hexdigest
    return base64.urlsafe_b64encode(bytes.fromhex(hexdigest)).rstrip(b"=").decode()


def judge(site, name, package, hashed=_sha256s):
    """[(dist-info path, its METADATA version or None, why it does not describe the files of
    package `package` in `site`, None when its RECORD matches them)] for every dist-info of
    distribution `name` in `site` (dist_infos order). `hashed`: {real path: hex sha256} of real
    paths (default safefs.sha256_file each; drift passes its cache)."""
    found = dist_infos(site, name)
    paths = dict((f, os.path.realpath(os.path.join(site, package, f))) for f in KEY_FILES)
    got = hashed(list(paths.values())) if found else {}
    disk = dict((f, b64(got.get(p))) for f, p in paths.items())
    judged = []
    for d in found:
        rec = record(d)
        version = metadata_version(d)
        listed = [f for f in KEY_FILES if (rec or {}).get("%s/%s" % (package, f))]
        if rec is None:
            why = "no RECORD%s" % ("" if version else ", no METADATA: a leftover of a failed install")
        elif not listed:
            why = "its RECORD lists none of %s" % ", ".join("%s/%s" % (package, f) for f in KEY_FILES)
        elif any(rec["%s/%s" % (package, f)] != disk[f] for f in listed):
            why = "its files are not the installed ones"
        else:
            why = None
        judged.append((d, version, why))
    return judged


def choose(site, name, package, hashed=_sha256s):
    """The dist-info of distribution `name` in site directory `site` whose RECORD matches the
    files of its top-level package `package` there (KEY_FILES: every one its RECORD lists with a
    sha256 has that hash on disk, and it lists at least one).

    Returns {"path": that dist-info (the only one when there is just one, matched or not: its
    drift is then reported file by file), None when there are several and none matches, or
    none at all; "version": its METADATA version or None; "stale": [{"path", "version", "why"}]
    the other dist-infos of `name` there; "warning": a sentence naming them all, None when
    there is only one}. Reads files only (nothing imported); `hashed` as judge's."""
    judged = judge(site, name, package, hashed)
    out = {"path": None, "version": None, "stale": [], "warning": None}
    if not judged:
        return out
    good = [j for j in judged if j[2] is None]
    pick = good[0] if good else (judged[0] if len(judged) == 1 else None)
    if pick is not None:
        out["path"], out["version"] = pick[0], pick[1]
    out["stale"] = [{"path": d, "version": v, "why": why or "a second dist-info whose RECORD also matches"}
                    for d, v, why in judged if pick is None or d != pick[0]]
    if len(judged) > 1:
        parts = ["%s (%s)" % (os.path.basename(d), "matches the installed files" if pick and d == pick[0]
                              else "stale: " + (why or "a second dist-info whose RECORD also matches"))
                 for d, v, why in judged]
        out["warning"] = "%d %s dist-infos in %s: %s%s" % (
            len(judged), name, site, "; ".join(parts),
            "" if pick else "; none matches the installed files: the version comes from the package's own files")
    return out


def constants(path):
    """{name: value} of the top-level constant assignments in the Python file at `path`
    (`__version__ = '2.5.1+cu124'`, `cuda: Optional[str] = '12.4'`), read with ast, never
    imported (nor through a link); {} when it is missing, unreadable or does not parse."""
    import ast
    try:
        tree = ast.parse(_read(path, 1 << 20) or "")
    except (SyntaxError, ValueError):
        return {}
    out = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
            out[target.id] = node.value.value
    return out


def version_py(package_dir):
    """`__version__` of the package in `package_dir` as its own files say it, read with ast: a
    string constant at the top of its version.py (sglang 0.4.6.post5, 0.5.2; torch), else of
    its _version.py (sglang 0.5.10 and 0.5.23's version.py imports it: `__version__ = version =
    '0.5.10'`, vcs-versioning's); None when neither has one."""
    for name in VERSION_MODULES:
        v = constants(os.path.join(package_dir, name)).get("__version__")
        if isinstance(v, str):
            return v
    return None


def release(package_dir, name=None):
    """{"dist": name (default the package's directory name), "version"} of the release whose
    files are in `package_dir`: its own version module's `__version__` (version_py), else the matching dist-info's
    (choose) version; None when neither says. What the change ledger records per change."""
    name = name or os.path.basename(package_dir.rstrip("/"))
    version = version_py(package_dir) or choose(os.path.dirname(package_dir.rstrip("/")), name,
                                                os.path.basename(package_dir.rstrip("/")))["version"]
    return {"dist": name, "version": version} if version else None
