"""Remote probe helper: torch's version and CUDA version, read from torch/version.py (torch is
never imported: that would load CUDA and take seconds).

Stdlib only (Python 3.8+), loaded by the facts and kbuild probe bundles.
"""

import importlib.util
import os
import sys

from . import distinfo


# {name: value} of the top-level constant assignments of a version module (distinfo.constants)
fields = distinfo.constants


def installed():
    """The torch `import torch` would load on sys.path, as the facts probe reports it:
    {"version", "cuda": torch.version.cuda, "metadata_warning"?, "reason"?}, or None when torch
    is not importable. "version" is what its files are: torch/version.py's `__version__`, else
    the version of the dist-info whose RECORD matches them (distinfo.choose), never the first
    dist-info listed (a stale one holding only REQUESTED has no version: python/cpython#100666);
    "metadata_warning" (only when there are any) names stale or duplicate torch dist-infos beside
    it or elsewhere on sys.path; "reason" (only when "version" is None) says why."""
    found = importable()
    if found is None:
        return None
    site = os.path.dirname(os.path.dirname(found["path"]))
    chosen = distinfo.choose(site, "torch", "torch")
    version = found["version"] if isinstance(found["version"], str) else chosen["version"]
    # a torch dist-info on another sys.path entry, with no torch beside it (a venv's leftover over
    # the system torch): importlib.metadata answers from it first
    elsewhere = ["%s (%s)" % (d, "stale: " + why if why else "another torch install, shadowed by this one")
                 for entry in sys.path
                 if entry and os.path.realpath(entry) != os.path.realpath(site)
                 for d, _, why in distinfo.judge(entry, "torch", "torch")]
    warning = "; ".join(w for w in (chosen["warning"], elsewhere and "torch dist-infos away from torch's own %s: %s"
                                    % (site, "; ".join(elsewhere))) if w) or None
    reason = None if version else (
        "%s has no __version__ and no torch dist-info in %s matches the installed files%s" % (
            found["path"], site, ": " + warning if warning else ""))
    out = {"version": version, "cuda": found["cuda"]}
    out.update(((k, v) for k, v in (("metadata_warning", warning), ("reason", reason)) if v))
    return out


def importable():
    """The torch `import torch` gives: {"version": torch.__version__, "cuda": torch.version.cuda,
    "path": its version.py}, or None when it is not importable (the kbuild probe's torch, which
    its builds use)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    found = fields(path)
    return {"version": found.get("__version__"), "cuda": found.get("cuda"), "path": path}
