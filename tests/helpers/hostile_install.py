"""A root-owned venv whose code records the uid it runs as (issue 48; review round 4, R4-1 to
R4-3), and a way to run a scenario where an unprivileged uid can start it.

The venv is made from this machine's pyenv CPython, whose standard library has no
`sitecustomize` (Debian's /usr/bin/python3 ships one, found first, which hides R4-1). Its
site-packages, all root's, hold:
- a path `.pth` (as `pip install -e` of a src-layout project writes) naming a directory of uid
  65534, which holds a `sitecustomize.py`: site.py imports it after every `.pth`;
- a setuptools-shaped editable finder for `numpy` (a `.pth` import line, the finder module)
  mapping it to uid 65534's checkout: R4-2's dependency of a dependency;
- a STAND-IN `sglang` 0.5.23 (a dist-info and a package, not SGLang, with the 0.5.23 wheel's own
  allocator/ package) that imports numpy, and a STAND-IN `torch` 2.13.0 that does too.
Each records "WHAT uid EUID" in MARKS (a 0666 file): whatever fleetctl does with the install,
no line may say uid 0.

/root is 0700 here; in_root_view() runs a command in a private mount namespace whose /root is
the lab's (lab/host.py root_binds: a 0711 tmpfs showing /root/.pyenv), so that any uid can start
the pyenv interpreter, as on a host whose Python lies under /opt or /usr/local.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from fleetctl.lab.host import root_binds
from fleetctl.wheels import ensure_wheel

NOBODY = 65534
ALLOCATOR = "sglang/srt/mem_cache/allocator/"
RECORD = ("import os\n"
          "with open({marks!r}, 'a') as f:\n"
          "    f.write('%s uid %d euid %d\\n' % ({what!r}, os.getuid(), os.geteuid()))\n")
FINDER = '''import importlib.abc, importlib.util, sys
MAPPING = {{"numpy": {numpy!r}}}
{record}
class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in MAPPING:
            return importlib.util.spec_from_file_location(name, MAPPING[name] + "/__init__.py",
                                                          submodule_search_locations=[MAPPING[name]])
        return None
def install():
    sys.meta_path.append(_Finder())
'''


def pyenv_python() -> str:
    """This machine's pyenv CPython (the interpreter the tests run), whose standard library has
    no sitecustomize; asserted."""
    base = Path(sys.base_prefix)
    assert not list((base / "lib").glob("python3*/sitecustomize.py")), f"{base} ships a sitecustomize"
    return str(Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}")


def make(top: Path) -> dict:
    """Build the install under `top` (a root 0755 directory). Returns {"python": the venv's,
    "site": its site-packages, "marks": MARKS, "tree": the sglang package directory}."""
    marks = top / "marks"
    marks.write_text("")
    marks.chmod(0o666)
    venv = top / "venv"
    subprocess.run([pyenv_python(), "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    alice = top / "alice"
    (alice / "lib").mkdir(parents=True)
    (alice / "numpy").mkdir()
    (alice / "lib" / "sitecustomize.py").write_text(RECORD.format(marks=str(marks), what="sitecustomize"))
    (alice / "numpy" / "__init__.py").write_text(RECORD.format(marks=str(marks), what="numpy"))
    subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(alice)], check=True)
    (site / "__editable__.alice_tools-0.1.pth").write_text(f"{alice / 'lib'}\n")
    (site / "__editable___numpy_2_3_0_finder.py").write_text(
        FINDER.format(numpy=str(alice / "numpy"), record=RECORD.format(marks=str(marks), what="numpy finder")))
    (site / "__editable__.numpy-2.3.0.pth").write_text(
        "import __editable___numpy_2_3_0_finder; __editable___numpy_2_3_0_finder.install()\n")
    for name, version in (("sglang", "0.5.23"), ("torch", "2.13.0")):
        pkg = site / name
        pkg.mkdir()
        (pkg / "__init__.py").write_text(f"import numpy\n__version__ = {version!r}\n"
                                         + RECORD.format(marks=str(marks), what=name))
        (pkg / "version.py").write_text(f"__version__ = {version!r}\n")
        dist = site / f"{name}-{version}.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (dist / "RECORD").write_text(f"{name}/__init__.py,,\n{name}/version.py,,\n")
    with zipfile.ZipFile(ensure_wheel("0.5.23")) as z:  # the release's own allocator, for the replay
        z.extractall(site, [n for n in z.namelist() if n.startswith(ALLOCATOR) and n.endswith(".py")])
    return {"python": str(venv / "bin" / "python"), "site": str(site), "marks": str(marks), "tree": str(site / "sglang")}


def marks(install: dict) -> list[str]:
    """The lines the install's code wrote: "WHAT uid UID euid EUID"."""
    return Path(install["marks"]).read_text().splitlines()


def in_root_view(argv: list[str], timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """Run `argv` (as root) in a private mount namespace whose /root is the lab's (module
    docstring; run as it is where /root may be passed through already: scripts/root-view.sh's).
    Returns the CompletedProcess (bytes, captured)."""
    if os.stat("/root").st_mode & 0o001:
        return subprocess.run(argv, capture_output=True, timeout=timeout, **kw)
    hd = Path(tempfile.mkdtemp(prefix="fc-rootview-", dir="/tmp"))
    (hd / "real-root").mkdir()
    try:
        script = " && ".join(["mount --make-rprivate /", *root_binds(hd)]) + " && exec " + shlex.join(argv)
        return subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True,
                              timeout=timeout, **kw)
    finally:
        os.rmdir(hd / "real-root")
        os.rmdir(hd)
