"""Remote probe helper: which servers in other mount namespaces are containers', and those containers.

Stdlib only (Python 3.8+), loaded by the facts probe bundle on the host. A process in another
mount namespace than the probe's (procs.py) is classified by its cgroup (/proc/PID/cgroup, with
the directory each line names in the host's cgroup file system: review N1), never by anything
the process itself chose (its argv, its files):
- a **container** when a line names a known runtime's scope (`libpod-ID` Podman, `docker-ID` or
  `/docker/ID` Docker, `cri-containerd-ID` containerd, `crio-ID` CRI-O; a 64-hex leaf under
  `kubepods`: a CRI container of the kubelet), and that cgroup directory is root's and outside
  any delegated subtree;
- **rootless** when such a scope is under `user@UID.service` (systemd's delegated subtree of
  UID) and belongs to UID: a rootless container of that user, entered (if at all) as that user;
- a **service** when its cgroup is a system service's (`/system.slice/NAME.service`, root's): a
  host server whose mount namespace is its own (PrivateTmp=, ProtectSystem=...), read through the
  host's own trusted interpreter like any host server (procs.find_servers, host_view);
- **foreign** otherwise (a process that unshared its mount namespace, LXC, nspawn, a forged or
  delegated cgroup...): listed with the reason, never entered.
A container's name, image and image id come from the runtime's own CLI (`podman inspect`,
`docker inspect`, `crictl inspect`) when that is on the host's PATH, and whether its root file
system is read-only from /proc/PID/mountinfo (the `/` mount's options). Nothing of the
container's files is read or run from here: every file of it is read by a probe run inside
(connection/command.py container_entry), under the interpreter /proc/PID/exe names (the
kernel's name for what the process executed, resolved inside), never its argv[0].
"""

import json
import os
import re
import shutil
import stat

from . import procs
from .. import bounded, enter

# cgroup path pattern -> runtime (the first that matches wins)
_SCOPES = [
    (re.compile(r"libpod-(?:conmon-)?([0-9a-f]{64})"), "podman"),
    (re.compile(r"cri-containerd-([0-9a-f]{64})"), "containerd"),
    (re.compile(r"crio-(?:conmon-)?([0-9a-f]{64})"), "cri-o"),
    (re.compile(r"docker[-/]([0-9a-f]{64})"), "docker"),
    (re.compile(r"/kubepods\b.*/([0-9a-f]{64})(?:\.scope)?$"), "unknown"),
]
# systemd's delegated subtree of a user (systemd.resource-control(5) Delegate=): user@UID.service
_DELEGATED = re.compile(r"/user@(\d+)\.service(?:/|$)")
# a system service's own cgroup (systemd.special(7): system.slice)
_SERVICE = re.compile(r"^/system\.slice/(?:[^/]+\.slice/)*[^/]+\.service$")
# the runtime CLI that enters a runtime's containers (crictl speaks for every CRI runtime, and
# for a kubelet's container whose runtime the cgroup does not name: "unknown")
RUNTIME_CLI = {"podman": "podman", "docker": "docker", "containerd": "crictl", "cri-o": "crictl", "unknown": "crictl"}
INSPECT_TIMEOUT_S = 15
MAX_FIELD = 512  # characters kept of a name or image reference (strings from the host are bounded)


def _field(v):
    return v[:MAX_FIELD] if isinstance(v, str) else None


def from_cgroup(text):
    """(runtime, container id, kubelet-managed) from the text of /proc/PID/cgroup; runtime
    "unknown" and id None when no line names a container ("unknown" with an id: a kubelet's
    container whose runtime the path does not name)."""
    runtime, cid, kube, _ = _scope(text)
    return runtime, cid, kube


def _scope(text):
    """from_cgroup's answer + the line that named the container (None when none did)."""
    kube = "kubepods" in text
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        for pat, runtime in _SCOPES:
            m = pat.search(path)
            if m:
                return runtime, m.group(1), kube, line
    return "unknown", None, kube, None


def _owner(line, mountinfo):
    """(the host directory of cgroup `line`, its owner uid or None when it is no directory)."""
    try:
        d = os.path.dirname(enter.cgroup_targets(line, mountinfo)[0])
        st = os.lstat(d)
    except (OSError, ValueError):
        return None, None
    return d, st.st_uid if stat.S_ISDIR(st.st_mode) else None


def classify(cgroup_text, mountinfo):
    """What a process in another mount namespace is, from its /proc/PID/cgroup text and the
    probe's /proc/self/mountinfo text (see the module docstring): {"kind": "container",
    "rootless", "service" or "foreign", "runtime", "container_id", "kubelet", "cgroup": the
    deciding line's path, "uid": the delegated user (rootless), "reason": why it is not a
    container (None for one)}."""
    runtime, cid, kube, line = _scope(cgroup_text)
    out = {"kind": "foreign", "runtime": runtime, "container_id": cid, "kubelet": kube, "cgroup": None,
           "uid": None, "reason": None}
    if line is None:
        # systemd's own lines: the unified hierarchy's, then (v1 and hybrid hosts) name=systemd
        lines = cgroup_text.splitlines()
        tracked = [ln for ln in lines if ln.startswith("0::")] + [ln for ln in lines if ":name=systemd:" in ln]
        path = tracked[0].split(":", 2)[2] if tracked else ""
        out["cgroup"] = path
        if any(_SERVICE.match(ln.split(":", 2)[2]) and _owner(ln, mountinfo)[1] == 0 for ln in tracked):
            out["kind"] = "service"
        else:
            out["reason"] = "its cgroup (%s) names no container runtime" % (path or "none")
        return out
    path = line.split(":", 2)[2]
    out["cgroup"] = path
    d, uid = _owner(line, mountinfo)
    deleg = _DELEGATED.search(path)
    if uid is None:
        out["reason"] = "its cgroup directory for %s is not on this host" % path
    elif deleg:
        out["uid"] = int(deleg.group(1))
        if uid == out["uid"]:
            out["kind"] = "rootless"
            out["reason"] = "a rootless container of uid %d (its cgroup %s is delegated to that user)" % (uid, path)
        else:
            out["reason"] = "its cgroup %s is under user@%s.service but belongs to uid %d" % (path, deleg.group(1), uid)
    elif uid != 0:
        out["reason"] = "its cgroup directory %s belongs to uid %d, not root" % (d, uid)
    else:
        out["kind"] = "container"
    return out


_MOUNTINFO = []


def mountinfo():
    """This probe's /proc/self/mountinfo text, read once."""
    if not _MOUNTINFO:
        _MOUNTINFO.append(procs.read("/proc/self/mountinfo") or "")
    return _MOUNTINFO[0]


def host_view(pid):
    """Whether process `pid` (in another mount namespace than the probe's) is a system service,
    read as a host server (procs.find_servers)."""
    return classify(procs.read("/proc/%d/cgroup" % pid) or "", mountinfo())["kind"] == "service"


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
    absent, fails, says something else or does not answer within INSPECT_TIMEOUT_S (bounded.run:
    a stuck one is left behind)."""
    path = shutil.which(cli)
    if not path or not container_id:
        return {}
    try:
        r = bounded.run([path, "inspect", container_id], INSPECT_TIMEOUT_S)
        doc = json.loads(r.stdout[:1 << 22]) if r.returncode == 0 else None
    except (OSError, ValueError):
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


def process(pid):
    """{uid, gid, start_time} of host process `pid`: its real uid and gid (/proc/PID/status Uid,
    Gid: first fields) and field 22 of /proc/PID/stat (its start time, connection/command.py
    container_entry checks it); None values where unreadable."""
    st = enter.status_fields(procs.read("/proc/%d/status" % pid) or "")
    try:
        start = enter.start_time(pid)
    except (OSError, IndexError):
        start = None
    ids = [(st.get(k) or "").split()[:1] for k in ("Uid", "Gid")]
    return {"uid": int(ids[0][0]) if ids[0] else None, "gid": int(ids[1][0]) if ids[1] else None,
            "start_time": start}


def containers(pids):
    """The containers of the server processes `pids` (pids as the host sees them, in other
    mount namespaces and not services: procs.find_servers), one entry per container or foreign
    process: [{"kind", "reason", "cgroup" (classify), "root": {runtime, container_id, name,
    image, image_id, pid}, "servers": [pid], "pids_in_container": {str(host pid): its pid in the
    container}, "python": the interpreter /proc/PID/exe names (a path inside the container),
    "process": process(), "kubelet": bool, "read_only_rootfs": bool or None}]. `root.pid` is
    the first server's pid; name, image and image_id are None without the runtime's CLI (and
    for what is no container)."""
    out = {}
    for pid in pids:
        kind = classify(procs.read("/proc/%d/cgroup" % pid) or "", mountinfo())
        cid = kind["container_id"] if kind["kind"] in ("container", "rootless") else None
        key = cid or "pid-%d" % pid
        if key in out:
            out[key]["servers"].append(pid)
            out[key]["pids_in_container"][str(pid)] = pid_in_container(pid)
            continue
        seen = inspect(RUNTIME_CLI.get(kind["runtime"], ""), cid) if kind["kind"] == "container" else {}
        try:
            exe = os.readlink("/proc/%d/exe" % pid)
        except OSError:
            exe = None
        out[key] = {"kind": kind["kind"], "reason": kind["reason"], "cgroup": kind["cgroup"],
                    "python": exe if exe and exe.startswith("/") and not exe.endswith(" (deleted)") else None,
                    "root": {"runtime": kind["runtime"], "container_id": cid, "name": seen.get("name"),
                             "image": seen.get("image"), "image_id": seen.get("image_id"), "pid": pid},
                    "servers": [pid], "pids_in_container": {str(pid): pid_in_container(pid)},
                    "process": process(pid), "kubelet": kind["kubelet"], "read_only_rootfs": read_only_root(pid)}
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
