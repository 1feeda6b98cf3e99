"""Remote probe helper: where `import sglang` resolves, asked of the interpreter itself.

Stdlib only (Python 3.8+). `locate()` runs inside the install's own interpreter, started by the
facts probe as `python -I` in `/` (site runs, so `.pth` files and PEP 660 editable finders work;
-I drops the probe's own environment and directory), with the server's working directory and
PYTHONPATH put first in `sys.path` as the server saw them at start. It asks
`importlib.util.find_spec("sglang")` for the top-level name only: that finds the package without
running `sglang/__init__.py` (a submodule spec would import the parent). A namespace package spec
(origin None: a bare `sglang/` directory without `__init__.py`) counts as not found.

The install kind (README, "installs"): `wheel` (a dist-info beside the package whose RECORD
lists its `__init__.py`), `editable` (a dist-info whose `direct_url.json` says
`dir_info.editable`, or an `sglang.egg-link`, pointing at the found location) or `checkout`
(anything else: found through the working directory or PYTHONPATH). The version is what the
package's files are: `__version__` of `sglang/version.py` or `sglang/_version.py`
(distinfo.version_py: read with ast, never imported), else the version of the dist-info whose RECORD matches the files (distinfo.choose); never "the first
dist-info listed", which after an interrupted upgrade can be a stale one (issue 49).
"""

import json
import os
import sys

from . import distinfo


def _same(a, b):
    return os.path.realpath(a) == os.path.realpath(b)


def _denied(entry):
    """Whether sys.path entry `entry` exists but may not be listed by this process."""
    try:
        os.listdir(entry or ".")
    except PermissionError:
        return True
    except OSError:
        return False
    return False


def _url_dir(url):
    """A file:// URL -> local path (PEP 610 direct_url.json), else None."""
    if not url.startswith("file://"):
        return None
    from urllib.parse import unquote, urlparse
    return unquote(urlparse(url).path)


def _editable_dir(dist):
    """The project directory of an editable dist (direct_url.json dir_info.editable), else None."""
    try:
        doc = json.loads(dist.read_text("direct_url.json") or "null")
    except ValueError:
        return None
    if isinstance(doc, dict) and (doc.get("dir_info") or {}).get("editable"):
        return _url_dir(doc.get("url") or "")
    return None


def _egg_link_dir():
    """The directory named by the first `sglang.egg-link` on sys.path (setup.py develop), else None."""
    for entry in sys.path:
        try:
            with open(os.path.join(entry or ".", "sglang.egg-link")) as f:
                return f.readline().strip() or None
        except OSError:
            continue
    return None


def locate(first):
    """Where `import sglang` resolves for this interpreter with the entries `first` (absolute
    paths) put at the front of sys.path.

    Returns {"python": {path, version}, "sglang": {version, location, package_dir, install,
    metadata_warning? (only when there is one: distinfo.choose's warning, stale or duplicate
    dist-infos beside it)} or None, "error": str or None, "unreadable": [sys.path entries that exist but this process may
    not list: its uid cannot see what is there, so the answer cannot be trusted]}. `error` is set when an sglang distribution is installed but its
    package directory cannot be found (its `location` is then the distribution's own directory
    and `package_dir` null)."""
    import importlib.util
    from importlib import metadata
    # `first` (a server's working directory and PYTHONPATH: any user's files) is on sys.path only
    # while find_spec looks for sglang, which imports nothing; what metadata imports lazily later
    # (email, string...) comes from the interpreter's own path: a module another user planted
    # there (string.py, json.py) is never imported by this root process (review round 3)
    added = [e for e in first if e not in sys.path]
    sys.path[:0] = added
    try:
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("sglang")
    finally:
        del sys.path[:len(added)]
    origin = getattr(spec, "origin", None) if spec else None
    package_dir = None
    if origin and os.path.basename(origin) == "__init__.py" and os.path.isfile(origin):
        package_dir = os.path.dirname(origin)
    dists = list(metadata.distributions(name="sglang", path=added + sys.path))
    dist = dists[0] if dists else None
    out = {"python": {"path": sys.executable, "version": "%d.%d.%d" % sys.version_info[:3]},
           "sglang": None, "error": None, "unreadable": [e for e in added + sys.path if _denied(e)]}
    if package_dir is None:
        if dist is not None:
            location = str(dist.locate_file(""))
            what = "no spec" if spec is None else (
                "a namespace package" if origin in (None, "namespace") else "not a package: %s" % origin)
            out["sglang"] = {"version": dist.version, "location": location, "package_dir": None,
                             "install": "editable" if _editable_dir(dist) else "wheel"}
            out["error"] = ("sglang package directory not found under %s: sglang %s is installed but "
                            "importlib.util.find_spec('sglang') gives %s" % (location, dist.version, what))
        return out
    location = os.path.dirname(package_dir)
    chosen = distinfo.choose(location, "sglang", "sglang")
    mine = next((d for d in dists if _editable_dir(d) and _same(_editable_dir(d), location)), None)
    egg = _egg_link_dir()
    if mine is not None or (egg and _same(egg, location)):
        install = "editable"
    elif any("sglang/__init__.py" in (distinfo.record(d) or {}) for d in distinfo.dist_infos(location, "sglang")):
        install = "wheel"
    else:
        install = "checkout"
    version = distinfo.version_py(package_dir) or (
        chosen["version"] if install == "wheel" else mine.version if mine is not None else None)
    out["sglang"] = {"version": version, "location": location, "package_dir": package_dir, "install": install}
    if chosen["warning"]:
        out["sglang"]["metadata_warning"] = chosen["warning"]
    return out
