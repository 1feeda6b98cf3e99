"""Remote probe helper: torch's version and CUDA version, read from torch/version.py (torch is
never imported: that would load CUDA and take seconds).

Stdlib only (Python 3.8+), loaded by the facts and kbuild probe bundles.
"""

import ast
import importlib.util
import os


def fields(path):
    """{name: value} of the top-level constant assignments in torch/version.py at `path`
    (`__version__ = '2.5.1+cu124'`, `cuda: Optional[str] = '12.4'`); {} when it is missing,
    unreadable or does not parse."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, ValueError, SyntaxError):
        return {}
    out = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
            out[target.id] = node.value.value
    return out


def installed():
    """The torch distribution on sys.path: {"version": its metadata version, "cuda":
    torch.version.cuda}, or None when there is none (the facts probe's torch)."""
    from importlib import metadata
    try:
        dist = metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        return None
    return {"version": dist.version, "cuda": fields(str(dist.locate_file("torch/version.py"))).get("cuda")}


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
