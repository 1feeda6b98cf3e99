"""Installs in containers: how fleetctl enters a container, names its install, and says what lasts.

The facts probe on the host lists the containers SGLang servers run in (probes/facts/containers.py:
which processes in other mount namespaces are containers', by their cgroups; runtime, container
id, name, image, image id, the host's pid). Each container is entered (`enter`) by the runtime's
own exec when its CLI is on the host (it applies the container's user, cgroup, seccomp and LSM
profile), else only when the inventory's `fleetctl_container_exec` asks (nsenter: probes/enter.py,
with the container process's uid, gid and capabilities at most, said in the report); the same
probes as on a host then run inside, under the container's own interpreter, and what they find
(hostile input, as any host's answer) is the container install `<runtime>:<name>:<package_dir>`
with its `root`.

A change inside a container lives in its writable layer: it lasts until the container is
recreated (LASTS), and is refused where even a restart loses it (REFUSED: a kubelet-managed
container, a read-only root file system). The host keeps a copy of each container change's
record (`record_path`: keyed by container id and image id), which is how `status` tells a
recreated container (CHANGE_LOST).
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import replace

from ..connection.command import CONTAINER_EXECS, container_entry
from ..connection.container import ContainerConnection
from ..errors import HostFailed
from ..probes.facts.containers import RUNTIME_CLI
from .context import HostContext

LASTS = "lasts until the container is recreated (the change is in the container's writable layer, not its image)"
REFUSED = "changes here do not survive a restart: use --export-patch"
CHANGE_LOST = "container recreated since the change: change lost"
# where the host keeps its copy of container change records, under the state dir
RECORDS = "containers"
NSENTER_NOTE = ("entered with fleetctl_container_exec: nsenter: the probe ran in the container's namespaces and "
                "cgroups with its process's uid and gid, no capabilities beyond its bounding set and "
                "no_new_privs, without its seccomp and LSM profile")


def how_to_enter(host, found: dict, clis: dict) -> tuple[str | None, str | None]:
    """(how the container `found` (probes/containers.containers entry) is entered: "podman",
    "docker", "crictl", "nsenter" or None for not at all, a note for the report or None).
    Only a container is entered (`kind` "container"; a rootless one only by nsenter, as its
    user); a foreign process never (its `reason` is the note). The inventory's
    fleetctl_container_exec wins; else the runtime's CLI when `clis` (probes/containers.clis)
    says it is on the host; nsenter only when asked (review N1: no CLI, not entered). Raises
    HostFailed for a fleetctl_container_exec that is no way in."""
    asked = host.container_exec
    if asked is not None and asked not in CONTAINER_EXECS:
        raise HostFailed(f"fleetctl_container_exec: {asked!r} is not one of {', '.join(CONTAINER_EXECS)} "
                         f"(fix the inventory var of host {host.name})")
    kind = found.get("kind")
    if kind not in ("container", "rootless"):
        return None, f"not entered: pid {found['root']['pid']} is no container's: {found.get('reason')}"
    if asked == "none":
        return None, "not entered: fleetctl_container_exec is none"
    if kind == "rootless":
        if asked == "nsenter":
            return "nsenter", NSENTER_NOTE
        return None, (f"not entered: {found.get('reason')}; fleetctl_container_exec: nsenter enters it as "
                      "that user")
    if asked:
        return asked, NSENTER_NOTE if asked == "nsenter" else None
    cli = RUNTIME_CLI.get(found["root"]["runtime"])
    if cli and clis.get(cli):
        return cli, None
    return None, (f"not entered: no {cli or 'runtime CLI'} on the host's PATH; fleetctl_container_exec: nsenter "
                  "enters it with its process's uid and gid and no more capabilities than it has")


def prefix(root: dict) -> str:
    """The install id prefix of a container: `<runtime>:<name>:` (the container id's first 12
    hex digits when the runtime's CLI gave no name)."""
    return f"{root['runtime']}:{root.get('name') or (root.get('container_id') or '?')[:12]}:"


def enter(ctx: HostContext, found: dict, how: str, within: float | None = None) -> HostContext:
    """`ctx` entered into container `found` (probes/containers.containers entry) with `how`;
    `within`: seconds the entered context's commands have in all (its deadline, at most the
    host's: engine/gather bounds each container's inspection so, and a runtime exec that never
    answers raises RemoteTimeout there); None: the host's deadline. Raises HostFailed when the
    container gives no way in (no id for a runtime exec)."""
    root = found["root"]
    try:
        entry = container_entry(how, root.get("container_id") or "", root["pid"], found.get("process") or {})
    except ValueError as e:
        raise HostFailed(f"container of pid {root['pid']}: {e}") from None
    inner = ctx.inside(ContainerConnection(ctx.conn, entry, found.get("python")),
                       {"how": how, "root": root, "found": found})
    if within is not None:
        inner = replace(inner, deadline=min(ctx.deadline, time.monotonic() + within))
    return inner


def exec_name(how: str) -> str:
    """What enters a container entered with `how`, as a report names it: "podman exec",
    "docker exec", "crictl exec", or "nsenter" (fleetctl's entry, probes/enter.py)."""
    return "nsenter" if how == "nsenter" else f"{how} exec"


def adopt(inner: dict, ctx: HostContext) -> dict:
    """The facts `inner` gathered inside the container ctx is in as its container installs:
    ids `<runtime>:<name>:<package_dir>`, each with `root` and `container` ({how, note,
    read_only_rootfs, kubelet, lasts}); the servers inside get the host's pids (`pid`, in the
    installs' `servers` too; None for a server the host did not list) and keep their own
    (`pid_in_container`). Returns {"installs",
    "servers"}."""
    c = ctx.container
    found = c["found"]
    pre = prefix(c["root"])
    info = {"how": c["how"], "note": NSENTER_NOTE if c["how"] == "nsenter" else None,
            "read_only_rootfs": found.get("read_only_rootfs"), "kubelet": found.get("kubelet"),
            "lasts": LASTS}
    ids = {inst["id"]: pre + inst["id"].split(":", 1)[1] for inst in inner.get("installs", [])}
    to_host = {inner_pid: int(pid) for pid, inner_pid in (found.get("pids_in_container") or {}).items()}
    servers = [{**s, "pid_in_container": s["pid"], "pid": to_host.get(s["pid"]),
                "install": ids.get(s.get("install")), "root": c["root"]}
               for s in inner["facts"].get("servers", [])]
    host_pid = {s["pid_in_container"]: s["pid"] for s in servers}
    installs = [{**inst, "id": ids[inst["id"]], "root": c["root"], "container": info,
                 "servers": [host_pid.get(p, p) for p in inst.get("servers", [])]}
                for inst in inner.get("installs", [])]
    return {"installs": installs, "servers": servers}


def refusal(inst: dict) -> str | None:
    """Why a change to container install `inst` is refused (REFUSED, with the reason), or None
    (also for a host install)."""
    info = inst.get("container")
    if not info:
        return None
    if info.get("kubelet"):
        return f"{inst['id']}: a kubelet-managed container (cgroup under kubepods): {REFUSED}"
    if info.get("read_only_rootfs"):
        return f"{inst['id']}: the container's root file system is read-only: {REFUSED}"
    return None


def restart_handlers(ctx: HostContext) -> list[dict]:
    """The restart handler of a container install: restart its container with the runtime's CLI
    (run on the host), or, entered by nsenter (no CLI), the host's fleetctl_restart_cmd."""
    how = ctx.container["how"]
    root = ctx.container["root"]
    if how in ("podman", "docker", "crictl"):
        verb = "stop" if how == "crictl" else "restart"  # the kubelet starts a stopped CRI container again
        return [{"name": "restart sglang", "command": shlex.join([how, verb, root["container_id"]])}]
    cmd = ctx.host.restart_cmd
    return [{"name": "restart sglang", "command": cmd}] if cmd else []


def restart_handler(root: dict) -> dict | None:
    """The restart handler of container `root` (a host change record's) run from its record
    alone, for a container a killed run left stopped or stuck stopping (its own restart cut
    short, after the stop signal and before the kill: `podman restart` refuses that state,
    `stop` finishes it): `<cli> stop <id> && <cli> start <id>` for podman and docker; None for a
    CRI container (the kubelet's) or a root without an id. Shape: {"name", "command"}."""
    cli = RUNTIME_CLI.get(root.get("runtime") or "")
    cid = "".join(ch for ch in str(root.get("container_id") or "") if ch in "0123456789abcdef")[:64]
    if cli not in ("podman", "docker") or not cid:
        return None
    return {"name": "restart sglang", "command": f"{shlex.join([cli, 'stop', cid])} && {shlex.join([cli, 'start', cid])}"}


GONE = "no such container"  # what podman and docker say, in any case, of a container id they do not have


def record_path(state_dir: str, root: dict) -> str:
    """Where the host keeps its copy of a container change record: STATE_DIR/containers/
    <container id>.<image id>.json (ids as hex; anything else in them dropped)."""
    def clean(v):
        return "".join(ch for ch in (v or "none").split(":")[-1] if ch in "0123456789abcdef")[:64] or "none"
    return f"{state_dir}/{RECORDS}/{clean(root.get('container_id'))}.{clean(root.get('image_id'))}.json"


def keep_record(ctx: HostContext, state_dir: str, install: str, changes: list[dict], changing: bool = False) -> None:
    """Write the host's copy of the ledger of container install `install` (ctx inside it):
    {root, install, changes: [{change_id, state, files}], changing}; `changing`: written before
    a changing run's work there (a run killed in it leaves it so: `fleetctl recover` starts the
    container again when it is stopped, and recovers in it). Raises OSError (the host refused)."""
    root = ctx.container["root"]
    doc = {"root": root, "install": install, "changing": changing,
           "changes": [{k: c.get(k) for k in ("change_id", "state", "files")} for c in changes]}
    ctx.conn.put_bytes(json.dumps(doc, sort_keys=True).encode(), record_path(state_dir, root),
                       timeout=ctx.remaining(), mode=0o600)  # on the host: the connection, not the entry


def lost_changes(records: list[dict], g: dict) -> list[dict]:
    """Host records (keep_record documents) whose container is gone while another container of
    the same image runs: [{"install", "container_id", "image_id", "changes", "problem":
    CHANGE_LOST}], for the records that hold an applied change."""
    running = {(i["root"]["container_id"], i["root"]["image_id"]) for i in g.get("installs", []) if i.get("root")}
    images = {img for _, img in running}
    out = []
    for r in records:
        root = r.get("root") or {}
        key = (root.get("container_id"), root.get("image_id"))
        applied = [c["change_id"] for c in r.get("changes", []) if c.get("state") == "applied"]
        if applied and key not in running and key[1] in images:
            out.append({"install": r.get("install"), "container_id": key[0], "image_id": key[1],
                        "changes": applied, "problem": CHANGE_LOST})
    return out
