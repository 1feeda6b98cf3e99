"""The install layouts real fleets have, added to a lab host beside its /opt/sglang/venv: an
editable checkout and a second venv, each with a stand-in server."""

from __future__ import annotations

import shutil
import sys
import zipfile
from pathlib import Path

from ..wheels import ensure_wheel
from .base import (PRIVATE_DIRS, SERVER_PORT, STANDIN_SRC, LabError, find_host, host_dir, load, require_root,
                   run, state_dir_for)
from .host import build_venv, in_host, stage_wheels, wait_server

CHECKOUT = "/opt/sglang/src/sglang"          # a git work tree laid out as SGLang's repository
EDITABLE_VENV = "/opt/sglang/venv-editable"  # `pip install -e CHECKOUT/python`
SECOND_VENV = "/opt/sglang/venv2"            # another release, beside /opt/sglang/venv
SECOND_STANDIN = "/opt/sglang/fleetctl-standin"
SECOND_PORT = SERVER_PORT + 1
SETUPTOOLS = "80.9.0"  # >= 70.1 (PEP 660 editable installs of a flat packages.find layout)
CHECKOUT_OWNER = "nobody"  # a developer's checkout is not root's: git must run as its owner


def add_install_layouts(host: str, checkout_release: str, second_release: str, lab_id: int = 0,
                        state_dir: Path | None = None) -> dict:
    """Give lab host `host` (of a lab that is up, built without servers) the install layouts
    fleets really have, next to its /opt/sglang/venv:

    - an editable checkout: CHECKOUT, a git work tree owned by CHECKOUT_OWNER holding python/
      (pyproject.toml, setuptools, packages.find) and python/sglang/ from the pure-Python release
      wheel `checkout_release`, installed `pip install -e` (PEP 660, setuptools SETUPTOOLS from
      the wheel cache, no index) into EDITABLE_VENV; the stand-in server runs from that venv on
      127.0.0.1:30000, started plainly;
    - SECOND_VENV with release `second_release`, and a stand-in server from it on
      127.0.0.1:SECOND_PORT started through `timeout` (a launcher that stays its parent).

    Returns {"restart_cmd": a handler command restarting both servers as they were started}.
    Raises LabError (a step failed, a release wheel that is not pure Python) or FleetctlError
    (a wheel cannot be had)."""
    require_root()
    sd = state_dir_for(lab_id, state_dir)
    h = find_host(load(sd), host)
    hd = host_dir(sd, h["name"])
    wheels = stage_wheels(sd, [checkout_release, second_release])
    if not wheels[checkout_release].name.endswith("-py3-none-any.whl"):
        raise LabError(f"sglang {checkout_release} is not pure Python ({wheels[checkout_release].name}): "
                       "an editable checkout needs no build step only for such a release")
    tools = sd / "wheels" / ensure_wheel(SETUPTOOLS, package="setuptools").name
    if not tools.exists():
        shutil.copyfile(ensure_wheel(SETUPTOOLS, package="setuptools"), tools)
    work = hd / PRIVATE_DIRS["/opt/sglang"] / CHECKOUT[len("/opt/sglang/"):]
    proj = work / "python"
    with zipfile.ZipFile(wheels[checkout_release]) as z:
        z.extractall(proj, [n for n in z.namelist() if n.startswith("sglang/")])
    (proj / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=70.1"]\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "sglang"\nversion = "{checkout_release}"\n\n'
        '[tool.setuptools.packages.find]\ninclude = ["sglang*"]\n')
    git = ["git", "-C", str(work), "-c", "user.name=fleetctl lab", "-c", "user.email=lab@example.invalid"]
    run(["git", "init", "-q", str(work)])
    run(git + ["add", "python"])
    run(git + ["commit", "-q", "-m", f"sglang {checkout_release} (from its release wheel)"])
    build_venv(h, sd, tools, EDITABLE_VENV)  # the build backend, from the cache (no build isolation)
    run(in_host(h["init_pid"]) + [sys.executable, "-m", "pip", "--python", f"{EDITABLE_VENV}/bin/python", "install",
                                  "--quiet", "--no-deps", "--no-index", "--no-build-isolation",
                                  "--disable-pip-version-check", "-e", f"{CHECKOUT}/python"], timeout=600)
    run(["chown", "-R", f"{CHECKOUT_OWNER}:", str(work)])
    build_venv(h, sd, wheels[second_release], SECOND_VENV)
    second = hd / PRIVATE_DIRS["/opt/sglang"] / SECOND_STANDIN[len("/opt/sglang/"):]
    for dst in (hd / PRIVATE_DIRS["/opt/fleetctl-standin"], second):
        shutil.copytree(STANDIN_SRC, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    first_cmd = f"PYTHON={EDITABLE_VENV}/bin/python /opt/fleetctl-standin/restart.sh"
    second_cmd = (f"PYTHON={SECOND_VENV}/bin/python LAUNCHER='timeout 86400' "
                  f"{SECOND_STANDIN}/restart.sh --port {SECOND_PORT}")
    for cmd in (first_cmd, second_cmd):
        run(in_host(h["init_pid"], "sh", "-c", cmd), timeout=120)
    wait_server(h)
    wait_server(h, port=SECOND_PORT)
    return {"restart_cmd": f"{first_cmd} && {second_cmd}"}
