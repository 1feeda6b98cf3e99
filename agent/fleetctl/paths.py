"""Where fleetctl finds its playbooks and kernel packages on the operator's machine.

The ones fleetctl ships are package data (`fleetctl.data.playbooks`, `fleetctl.data.kernels`,
built from the top-level `playbooks/` and `kernels/`), found with importlib.resources; run from a
source checkout (agent/ on sys.path, nothing built), they are that checkout's top-level
directories. `--playbooks-dir` / `--kernels-dir` (or $FLEETCTL_PLAYBOOKS_DIR /
$FLEETCTL_KERNELS_DIR) name others. Nothing is taken from the current directory unless named:
a playbook given as a path to a .yaml file is read from that path.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from .errors import ParseError

KINDS = ("playbooks", "kernels")
# A source checkout: agent/fleetctl/paths.py -> the repository root holds pyproject.toml.
_CHECKOUT = Path(__file__).resolve().parents[2]


def shipped_dir(kind: str) -> Path:
    """The directory of `kind` ("playbooks" or "kernels") that ships with fleetctl: the
    installed package data, else (a source checkout) the checkout's top-level directory.
    Raises ParseError (exit 4) when neither exists (a broken install)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}")
    # fleetctl.data is a regular package, so files() is a real directory; its playbooks/ and
    # kernels/ children have no __init__.py (they are the top-level directories, mapped).
    d = resources.files("fleetctl.data").joinpath(kind)
    if isinstance(d, Path) and d.is_dir():
        return d
    local = _CHECKOUT / kind
    if (_CHECKOUT / "pyproject.toml").is_file() and local.is_dir():
        return local
    raise ParseError(f"fleetctl's {kind} are not installed (no package fleetctl.data.{kind}); "
                     f"name a directory with --{kind}-dir")


def project_dir(kind: str, override: str | Path | None = None) -> Path:
    """The directory of `kind`: `override` (an option or its env var) when given, else
    shipped_dir(kind). Raises ParseError (exit 4) when `override` is not a directory."""
    if override:
        d = Path(override)
        if not d.is_dir():
            raise ParseError(f"--{kind}-dir {d}: no such directory")
        return d
    return shipped_dir(kind)


def find_playbook(name: str, playbooks_dir: str | Path | None = None) -> Path:
    """A playbook by path (a .yaml/.yml file that exists), or by name in the playbooks
    directory (NAME or NAME.yaml; see project_dir). Raises ParseError (exit 4, like a missing
    inventory) when there is none."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    d = project_dir("playbooks", playbooks_dir)
    for cand in (d / f"{name}.yaml", d / f"{name}.yml"):
        if cand.exists():
            return cand
    known = sorted(x.stem for x in d.glob("*.y*ml"))
    raise ParseError(f"no playbook {name!r} in {d} (playbooks there: {', '.join(known) or 'none'})")
