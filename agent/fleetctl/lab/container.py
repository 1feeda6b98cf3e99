"""A container host: a lab host with its own rootful Podman, running the stand-in server in a
container of an image built here from this machine's Python (no registry is reached)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from .base import (SERVER_PORT, STANDIN_SRC, VENV, VENV_PYTHONS, LabError, find_host, host_dir, load,
                   require_root, run, state_dir_for)
from .host import in_host, stage_wheels, wait_server
from .layouts import CHECKOUT

CONTAINER_IMAGE = "localhost/fleetctl-lab/sglang-standin"  # :<release>, built by build_container_image
CONTAINER_NAME = "sglang"
IMAGE_STORE = "/var/lib/fleetctl-images"  # inside a lab host: the shared store, mounted read-only
# in-host path -> directory name under <state_dir>/hosts/<name>/: Podman's own state, per lab host
CONTAINER_DIRS = {"/var/lib/containers": "var-lib-containers", "/run/containers": "run-containers",
                  "/run/libpod": "run-libpod", "/etc/containers": "etc-containers"}
# ulimits given explicitly: Podman's defaults (the engine's own nofile/nproc) are not permitted here
CONTAINER_ULIMITS = ("nofile=1024:1024", "nproc=4096:4096")
# where a container lab host's stand-in finds torch: this machine's site-packages, mounted read-only
STANDIN_DEPS = "/opt/fleetctl-standin-deps"
# what the stand-in needs of the lab's Python (torch and what `import torch` imports): the system
# libraries they link to go into the image
_IMAGE_PACKAGES = ("torch", "torchgen", "functorch", "typing_extensions", "sympy", "mpmath", "networkx",
                   "jinja2", "markupsafe", "filelock", "fsspec", "numpy", "numpy.libs")
_STORAGE_CONF = ('[storage]\ndriver = "overlay"\nrunroot = "/run/containers/storage"\n'
                 'graphroot = "/var/lib/containers/storage"\n\n[storage.options]\n'
                 f'additionalimagestores = ["{IMAGE_STORE}"]\n')
_CONTAINERS_CONF = ('[engine]\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\nruntime = "runc"\n'
                    '[containers]\nlog_driver = "k8s-file"\n')


def _image_rootfs(root: Path, release: str, wheel: Path) -> None:
    """Lay out an image's root filesystem at `root`: the lab's Python (this interpreter's prefix:
    its binary, libpython, the standard library without tests or site-packages; what the
    stand-in imports, torch, is mounted at STANDIN_DEPS when the container runs), the shared
    libraries all of that links to (ldd),
    an editable SGLang checkout of `release` (CHECKOUT/python, installed as pip does a PEP 660
    editable install of a flat layout: a `.pth` naming the project directory and a dist-info
    whose direct_url.json says editable) in the venv VENV, and the stand-in at
    /opt/fleetctl-standin. No sh, no coreutils: like a distroless image. Files are hard links
    where the file system allows (the image is tarred right after)."""
    prefix = Path(sys.base_prefix)
    ver = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    site = prefix / "lib" / ver / "site-packages"

    def put(src: Path, dst: Path | None = None) -> None:
        dst = root / str(dst or src).lstrip("/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            run(["cp", "-al", str(src), str(dst)])
        elif not dst.exists():
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)

    for d in ("tmp", "proc", "sys", "dev", "etc", "run", "var/lib/fleetctl"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "tmp").chmod(0o1777)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/nonexistent\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    put(Path(os.path.realpath(sys.executable)), prefix / "bin" / ver)
    for lib in sorted((prefix / "lib").glob("libpython3*.so*")):
        put(lib)
    stdlib = prefix / "lib" / ver
    for entry in sorted(stdlib.iterdir()):
        if entry.name not in ("site-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip"):
            put(entry)
    # what the stand-in imports (torch) is not SGLang: the container mounts it read-only from this
    # machine (STANDIN_DEPS), found through a .pth file, which keeps the image small to build
    (root / str(site).lstrip("/")).mkdir(parents=True, exist_ok=True)
    (root / str(site).lstrip("/") / "fleetctl-standin-deps.pth").write_text(STANDIN_DEPS + "\n")
    # the system libraries every binary there links to, at their own paths
    deps = [site / e.name for e in sorted(site.iterdir())
            if e.name.split("-")[0].lower().removesuffix(".py") in _IMAGE_PACKAGES]
    elfs = [p for top in [root, *deps] if top.is_dir() for p in top.rglob("*")
            if p.is_file() and (p.suffix == ".so" or ".so." in p.name or p.name == ver)]
    libs: set[str] = set()
    for i in range(0, len(elfs), 200):
        r = run(["ldd", *map(str, elfs[i:i + 200])], check=False, timeout=300)
        for line in r.stdout.splitlines():
            parts = line.split()
            if "=>" in parts and len(parts) > parts.index("=>") + 1 and parts[parts.index("=>") + 1].startswith("/"):
                libs.add(parts[parts.index("=>") + 1])
            elif parts and parts[0].startswith("/") and "ld-linux" in parts[0]:
                libs.add(parts[0])
    for lib in sorted(libs):
        if not str(lib).startswith(str(prefix)):
            dst = root / lib.lstrip("/")
            dst.parent.mkdir(parents=True, exist_ok=True)
            if not dst.exists():
                shutil.copy2(os.path.realpath(lib), dst)
    if not (root / "lib64").exists():
        (root / "lib64").mkdir()
    ld = root / "lib64" / "ld-linux-x86-64.so.2"
    if not ld.exists() and Path("/lib64/ld-linux-x86-64.so.2").exists():
        shutil.copy2(os.path.realpath("/lib64/ld-linux-x86-64.so.2"), ld)
    # the venv, as `python -m venv --system-site-packages` lays it out
    venv = root / VENV.lstrip("/")
    (venv / "bin").mkdir(parents=True)
    for name in VENV_PYTHONS:
        (venv / "bin" / name).symlink_to(prefix / "bin" / ver)
    (venv / "pyvenv.cfg").write_text(f"home = {prefix / 'bin'}\ninclude-system-site-packages = true\n"
                                     f"version = {sys.version_info[0]}.{sys.version_info[1]}.{sys.version_info[2]}\n")
    vsite = venv / "lib" / ver / "site-packages"
    vsite.mkdir(parents=True)
    proj = root / CHECKOUT.lstrip("/") / "python"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(proj, [n for n in z.namelist() if n.startswith("sglang/")])
    (proj / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=70.1"]\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "sglang"\nversion = "{release}"\n\n'
        '[tool.setuptools.packages.find]\ninclude = ["sglang*"]\n')
    (vsite / f"__editable__.sglang-{release}.pth").write_text(f"{CHECKOUT}/python\n")
    dist = vsite / f"sglang-{release}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {release}\n")
    (dist / "INSTALLER").write_text("pip\n")
    (dist / "direct_url.json").write_text(json.dumps({"url": f"file://{CHECKOUT}/python",
                                                      "dir_info": {"editable": True}}))
    (dist / "RECORD").write_text("".join(f"{dist.name}/{n},,\n" for n in
                                         ("METADATA", "INSTALLER", "direct_url.json", "RECORD")) +
                                 f"__editable__.sglang-{release}.pth,,\n")
    standin = root / "opt" / "fleetctl-standin"
    shutil.copytree(STANDIN_SRC, standin, ignore=shutil.ignore_patterns("__pycache__"))


def image_store_dir(state_dir: Path) -> Path:
    """The lab's shared image store (Podman's graph root layout), under the lab's state dir: built
    once, kept across lab_down, read-only in every container lab host."""
    return state_dir / "image-store"


def build_container_image(release: str, lab_id: int = 0, state_dir: Path | None = None) -> str:
    """Build (once: kept in the lab's image store, image_store_dir) the image
    CONTAINER_IMAGE:<release> from the root filesystem _image_rootfs lays out, with `podman
    import` (no registry is reached). Returns the image reference. Raises LabError."""
    require_root()
    sd = state_dir_for(lab_id, state_dir)
    ref = f"{CONTAINER_IMAGE}:{release}"
    store = image_store_dir(sd)
    pod = ["podman", "--root", str(store), "--runroot", str(sd / "image-store-run"), "--storage-driver", "overlay"]
    if run([*pod, "image", "exists", ref], check=False).returncode == 0:
        return ref
    wheel = stage_wheels(sd, [release])[release]
    rootfs = sd / "image-rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    rootfs.mkdir()
    try:
        _image_rootfs(rootfs, release, wheel)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        r = subprocess.run([*pod, "import", "--change", "WORKDIR /", "-", ref], stdin=tar.stdout,
                           capture_output=True, text=True, timeout=900)
        tar.stdout.close()
        if tar.wait() != 0 or r.returncode != 0:
            raise LabError(f"podman import of {ref} failed: {r.stderr[-1500:]}")
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)
    return ref


def container_run_argv(image: str, name: str = CONTAINER_NAME, read_only: bool = False) -> list[str]:
    """The arguments of `podman run` for the lab's containerised stand-in server: rootful, runc,
    the host's network (the server answers on the lab host's 127.0.0.1:SERVER_PORT), explicit
    ulimits, the venv's interpreter executed directly (the image has no shell)."""
    # the stand-in is the container's PID 1, which a SIGTERM it has no handler for does not stop
    return ["run", "-d", "--name", name, "--runtime", "runc", "--network", "host", "--stop-timeout", "2",
            *[w for u in CONTAINER_ULIMITS for w in ("--ulimit", u)], *(["--read-only"] if read_only else []),
            "--volume", f"{sysconfig.get_paths()['purelib']}:{STANDIN_DEPS}:ro",
            image, f"{VENV}/bin/python", "/opt/fleetctl-standin/server.py", "--host", "127.0.0.1",
            "--port", str(SERVER_PORT), "--model-path", "fleetctl-standin/tiny", "--tp-size", "1"]


def podman_in(host: str, args: list[str], lab_id: int = 0, state_dir: Path | None = None,
              timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """Run `podman ARGS` inside lab host `host` (its own Podman state). Raises LabError when
    `check` and it fails."""
    sd = state_dir_for(lab_id, state_dir)
    h = find_host(load(sd), host)
    r = run(in_host(h["init_pid"], "podman", *args), check=False, timeout=timeout)
    if check and r.returncode != 0:
        raise LabError(f"{host}: podman {' '.join(args)} failed: {r.stderr[-1500:]}")
    return r


def add_container_host(host: str, release: str, lab_id: int = 0, state_dir: Path | None = None,
                       read_only: bool = False) -> dict:
    """Give lab host `host` (of a lab that is up, built without servers) its own rootful Podman
    (private /var/lib/containers, /run/containers, /run/libpod and /etc/containers, bind-mounted
    in its mount namespace, so `podman ps` there shows only its containers; the lab's image
    store mounted read-only as an additional image store) and run the stand-in server in a
    container CONTAINER_NAME of image build_container_image(release), then wait for its health.
    Returns {"image", "name", "restart_cmd"}. Raises LabError."""
    require_root()
    sd = state_dir_for(lab_id, state_dir)
    image = build_container_image(release, lab_id, sd)
    h = find_host(load(sd), host)
    hd = host_dir(sd, h["name"])
    binds = []
    for path, d in {**CONTAINER_DIRS}.items():
        (hd / d).mkdir(parents=True, exist_ok=True)
        Path(path).mkdir(parents=True, exist_ok=True)  # the mount point on the shared root
        binds.append(f"mount --bind {hd / d} {path}")
    for src in Path("/etc/containers").glob("*"):
        if src.is_file() and src.name not in ("storage.conf", "containers.conf"):
            shutil.copy2(src, hd / CONTAINER_DIRS["/etc/containers"] / src.name)
    (hd / CONTAINER_DIRS["/etc/containers"] / "storage.conf").write_text(_STORAGE_CONF)
    (hd / CONTAINER_DIRS["/etc/containers"] / "containers.conf").write_text(_CONTAINERS_CONF)
    Path(IMAGE_STORE).mkdir(parents=True, exist_ok=True)
    binds.append(f"mount --bind {image_store_dir(sd)} {IMAGE_STORE} && mount -o remount,bind,ro {IMAGE_STORE}")
    run(["nsenter", "-t", str(h["init_pid"]), "-m", "sh", "-c", " && ".join(binds)])
    podman_in(host, container_run_argv(image, read_only=read_only), lab_id, sd)
    wait_server(h)
    return {"image": image, "name": CONTAINER_NAME, "restart_cmd": f"podman restart {CONTAINER_NAME}"}
