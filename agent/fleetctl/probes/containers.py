"""Remote probe helper: the containers SGLang servers in other mount namespaces run in.

Stdlib only (Python 3.8+), loaded by the facts probe bundle on the host. A server whose process
lives in another mount namespace is a container's: its runtime and container id come from
/proc/PID/cgroup (the path names the runtime's scope: `libpod-ID` Podman, `docker-ID` or
`/docker/ID` Docker, `cri-containerd-ID` containerd, `crio-ID` CRI-O; `kubepods` in it means the
kubelet manages the container), its name, image and image id from the runtime's own CLI
(`podman inspect`, `docker inspect`, `crictl inspect`) when that is on the host's PATH, and
whether its root file system is read-only from /proc/PID/mountinfo (the `/` mount's options).
Nothing of the container's files is read from here: every file of it is read by a probe run
inside (connection/command.py container_entry), never through /proc/PID/root.
"""

import json
import os
import re
import shutil
import subprocess

from . import procs

# cgroup path pattern -> runtime (the first that matches wins)
_SCOPES = [
    (re.compile(r"libpod-(?:conmon-)?([0-9a-f]{64})"), "podman"),
    (re.compile(r"cri-containerd-([0-9a-f]{64})"), "containerd"),
    (re.compile(r"crio-(?:conmon-)?([0-9a-f]{64})"), "cri-o"),
    (re.compile(r"docker[-/]([0-9a-f]{64})"), "docker"),
    (re.compile(r"/([0-9a-f]{64})(?:\.scope)?$"), "unknown"),
]
# the runtime CLI that enters a runtime's containers (crictl speaks for every CRI runtime)
RUNTIME_CLI = {"podman": "podman", "docker": "docker", "containerd": "crictl", "cri-o": "crictl"}
INSPECT_TIMEOUT_S = 15
MAX_FIELD = 512  # characters kept of a name or image reference (strings from the host are bounded)


def _field(v):
    return v[:MAX_FIELD] if isinstance(v, str) else None


def from_cgroup(text):
    """(runtime, container id, kubelet-managed) from the text of /proc/PID/cgroup; runtime
    "unknown" and id None when no line names a container."""
    kube = "kubepods" in text
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        for pat, runtime in _SCOPES:
            m = pat.search(path)
            if m:
                return runtime, m.group(1), kube
    return "unknown", None, kube


def read_only_root(pid):
    """True when the mount at `/` of process `pid` is read-only (/proc/PID/mountinfo, proc(5):
    field 5 is the mount point, field 6 its options); None when unreadable."""
    text = procs.read("/proc/%d/mountinfo" % pid)
    if text is None:
        return None
    for line in text.splitlines():
        f = line.split()
        if len(f) > 5 and f[4] == "/":
            return "ro" in f[5].split(",")
    return None


def pid_in_container(pid):
    """The pid of host process `pid` in its own (innermost) PID namespace: the last field of
    the NSpid line of /proc/PID/status (proc(5)); `pid` itself when there is none."""
    for line in (procs.read("/proc/%d/status" % pid) or "").splitlines():
        if line.startswith("NSpid:"):
            f = line.split()[1:]
            if f and f[-1].isdigit():
                return int(f[-1])
    return pid


def inspect(cli, container_id):
    """{name, image, image_id, pid} of a container as its runtime's CLI `cli` reports it (podman
    and docker `inspect`: Name, ImageName/Config.Image, Image, State.Pid; crictl `inspect`:
    status.metadata.name, status.image.image, status.imageRef, info.pid); {} when the CLI is
    absent, fails or says something else."""
    path = shutil.which(cli)
    if not path or not container_id:
        return {}
    try:
        r = subprocess.run([path, "inspect", container_id], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           timeout=INSPECT_TIMEOUT_S)
        doc = json.loads(r.stdout[:1 << 22].decode("utf-8", "replace")) if r.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return {}
    if isinstance(doc, list) and doc and isinstance(doc[0], dict):
        d = doc[0]
        image = d.get("ImageName") or (d.get("Config") or {}).get("Image")
        return {"name": _field((d.get("Name") or "").lstrip("/")), "image": _field(image),
                "image_id": _field(d.get("Image")), "pid": (d.get("State") or {}).get("Pid")}
    if isinstance(doc, dict) and isinstance(doc.get("status"), dict):
        st = doc["status"]
        return {"name": _field((st.get("metadata") or {}).get("name")),
                "image": _field((st.get("image") or {}).get("image")),
                "image_id": _field(st.get("imageRef")), "pid": (doc.get("info") or {}).get("pid")}
    return {}


def clis():
    """{cli: True} for each runtime CLI (podman, docker, crictl) on this host's PATH."""
    return dict((c, bool(shutil.which(c))) for c in ("podman", "docker", "crictl"))


def containers(pids):
    """The containers of the server processes `pids` (pids as the host sees them), one entry per
    container: [{"root": {runtime, container_id, name, image, image_id, pid}, "servers": [pid],
    "pids_in_container": {str(host pid): its pid in the container}, "python": the first
    server's interpreter as the container sees it (its absolute argv[0], else /proc/PID/exe),
    "kubelet": bool, "read_only_rootfs": bool or None}]. `root.pid` is the first server's pid;
    name, image and image_id are None without the runtime's CLI."""
    out = {}
    for pid in pids:
        runtime, cid, kube = from_cgroup(procs.read("/proc/%d/cgroup" % pid) or "")
        key = cid or "pid-%d" % pid
        if key in out:
            out[key]["servers"].append(pid)
            out[key]["pids_in_container"][str(pid)] = pid_in_container(pid)
            continue
        seen = inspect(RUNTIME_CLI.get(runtime, ""), cid)
        argv = [a.decode("utf-8", "replace")[:procs.MAX_ARG]
                for a in (procs.read("/proc/%d/cmdline" % pid, "rb") or b"").split(b"\0")]
        try:
            exe = os.readlink("/proc/%d/exe" % pid)
        except OSError:
            exe = None
        out[key] = {"python": argv[0] if argv and argv[0].startswith("/") else exe,
                    "root": {"runtime": runtime, "container_id": cid, "name": seen.get("name"),
                             "image": seen.get("image"), "image_id": seen.get("image_id"), "pid": pid},
                    "servers": [pid], "pids_in_container": {str(pid): pid_in_container(pid)},
                    "kubelet": kube, "read_only_rootfs": read_only_root(pid)}
    return list(out.values())


MAX_RECORD = 1 << 20  # bytes read of one host-side container change record


def records(directory):
    """The host's copies of container change records (container.keep_record): the JSON
    documents in `directory`, each opened without following a symlink and read to MAX_RECORD
    bytes; unreadable or malformed ones are left out."""
    out = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return out
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            doc = json.loads(os.read(fd, MAX_RECORD).decode("utf-8", "replace"))
        except (OSError, ValueError):
            doc = None
        finally:
            os.close(fd)
        if isinstance(doc, dict):
            out.append(doc)
    return out
