"""A local cache of SGLang release wheels, downloaded once and shared by every lab host and test.

The cache directory is `$FLEETCTL_WHEEL_CACHE`, else `~/.cache/fleetctl/wheels`.
Wheels come from PyPI with `pip download --no-deps` (the only network use of the project).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .errors import FleetctlError
from .hostpaths import release


def cache_dir() -> Path:
    """The wheel cache directory (created if missing)."""
    d = Path(os.environ.get("FLEETCTL_WHEEL_CACHE", Path.home() / ".cache" / "fleetctl" / "wheels"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def find_wheel(version: str, package: str = "sglang") -> Path | None:
    """The cached wheel of `package==version`, or None if it is not cached. Raises
    hostpaths.Refused when `version` (a host's, often) is not a canonical PEP 440 public version:
    it is a glob here and a requirement for pip in ensure_wheel."""
    for w in sorted(cache_dir().glob(f"{package}-{release(version)}-*.whl")):
        return w
    return None


def ensure_wheel(version: str, package: str = "sglang", timeout: float = 600.0) -> Path:
    """Return the wheel of `package==version`, downloading it into the cache if missing.

    Args: version like "0.5.10"; timeout in seconds for the download.
    Raises FleetctlError when pip cannot download it (no such release, no network), and
    hostpaths.Refused (one) before pip runs when `version` is not a canonical PEP 440 public version.
    """
    w = find_wheel(version, package)  # checks `version` (hostpaths.release)
    if w is not None:
        return w
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "-d", str(cache_dir()), f"{package}=={version}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    w = find_wheel(version, package)
    if r.returncode != 0 or w is None:
        raise FleetctlError(f"cannot download {package}=={version}: {r.stderr.strip()[-500:]}")
    return w
