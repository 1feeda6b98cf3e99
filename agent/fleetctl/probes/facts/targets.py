"""Remote probe helper: which servers fleetctl's HTTP probes talk to, and on which socket (review N6).

The one rule for every probe that sends a request, and the inventory's API key with it, to an
SGLang server on this host (the smoke decode today: probes/traffic/smoke.py). A target is a listening
socket of a server the facts probe identified: its inode is in /proc/PID/fd of the server or of
one of its descendants (a router's DP workers, SGLang's scheduler processes), looked up in the
server's own network namespace (listeners.py), and it is reached on loopback or on an address of
this host. A process's argv (`--host`, `--port`: sglang/srt/server_args.py) is anyone's to write:
it only says which of the server's own sockets to use, never where to connect.

- A socket on 0.0.0.0 is reached on 127.0.0.1, one on :: on ::1 (127.0.0.1 when the namespace has
  no ::1), one on an IPv4-mapped address on its IPv4 address, one on a specific address of this
  host on that address; one on any other address is refused.
- A connection that could land on another process's socket (the same port on the wildcard of
  the other family, say) is refused: the kernel, not fleetctl, would pick the listener.
- The inventory's fleetctl_sglang_port / fleetctl_sglang_host select among the identified
  servers' sockets: a port no identified server listens on is refused, never used.
- A server that listens on nothing yet (still loading, just restarted) is pending: the caller
  asks again until its deadline. A server whose pid is gone is followed to its successor: a
  server identified now as the facts probe identifies them (procs.find_servers, with system
  services in their own mount namespaces: containers.host_view) with the same interpreter that
  claims the same port, the same effective uid, and the same systemd service or (outside one)
  the same parent while it runs (_succeeds), which is how a gate finds the server a restart
  replaced (a restart keeps those; it may change the environment and working directory the
  server starts from, so its import path).
- A server is identified by its owner as well as its socket (review R4-4): its effective uid is
  root's, the inventory's fleetctl_server_user's, or (that not set) the owner of its
  interpreter's environment, or it runs in a system service (owner_refusal). Any other process,
  however server-shaped its argv and its own its socket, is refused: no request, no API key.

Each refusal names the process (pid), what it claimed (host, port) and why; nothing is sent to it.
Each target carries the node rank its process's command line gives (topology.read): a server of
rank 1 and above is a non-zero-rank node of a multi-node deployment, whose port serves only
/health (SGLang's dummy health server: engine.py `launch_dummy_health_check_server`).
"""

import ipaddress
import os

from . import containers, listeners, procs, topology
from .. import runas

NOT_IDENTIFIED = "the listener of a process that is no identified server"
GONE = "pid %d exited and no server of the same interpreter on its port has taken its place"


def _ip(address):
    """ipaddress object of `address` (an IPv4-mapped IPv6 address as its IPv4), None when it is none."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    return getattr(ip, "ipv4_mapped", None) or ip


def _hostport(address, port):
    return ("[%s]:%d" if ":" in address else "%s:%d") % (address, port)


def _local(address, local):
    """`address` normalised when it is loopback or one of `local` (this namespace's), else None."""
    ip = _ip(address)
    if ip is None or not (ip.is_loopback or str(ip) in local):
        return None
    return str(ip)


def connect_address(bound, local):
    """Where to connect to reach a socket bound to address `bound`, given the namespace's own
    addresses `local`: (address, None), or (None, why) for an address that is not this host's."""
    ip = _ip(bound)
    if ip is not None and ip.is_unspecified:
        return ("::1" if ip.version == 6 and "::1" in local else "127.0.0.1"), None
    address = _local(bound, local)
    if address is None:
        return None, "is bound to %s, not an address of this host" % bound
    return address, None


def lands(address, bound):
    """Whether a connection to `address` (normalised) may be accepted by a socket bound to
    `bound` (as listeners reads it): the same address, its family's wildcard, or for IPv4 the
    IPv6 wildcard (a dual-stack socket) and the IPv4-mapped form."""
    if ":" in address:
        return bound in (address, "::")
    return bound in (address, "0.0.0.0", "::", "::ffff:" + address)


def _listener(inode, owner):
    return "server pid %d's listener" % owner[inode] if inode in owner else NOT_IDENTIFIED


def _whose(inode, owner):
    return "server pid %d" % owner[inode] if inode in owner else "a process that is no identified server"


def select(servers, listening, local, port=None, host=None):
    """The rule (see the module docstring), pure. `servers`: [{pid, port, host (what its argv
    claims), here: [(inode, address, port)] its tree's listening sockets in this namespace,
    elsewhere: [(address, port)] those in other namespaces, gone: why it is gone, or None}];
    `listening`: [(inode, address, port)] every listening socket of this namespace; `local`: its
    addresses; `port`, `host`: the inventory's fleetctl_sglang_port and _host (None: each server's
    own claimed port selects its socket). Returns {"targets": [{pid, host, port}], "refused":
    [{pid, host, port, reason}], "pending": [{pid, host, port, reason, exited}]}; refused and
    pending entries carry what was claimed (pid None: the inventory's choice); a pending entry is
    `exited` when every server it waits for is gone (nothing running can still listen there)."""
    owner = {inode: s["pid"] for s in servers for inode, _, _ in s["here"]}
    out = {"targets": [], "refused": [], "pending": []}
    if port is None:
        for s in servers:
            _claimed(s, listening, local, owner, out)
    else:
        _named(servers, listening, local, owner, int(port), host, out)
    return out


def _claimed(s, listening, local, owner, out):
    """Server `s` on its own claimed port: its socket there, reached as connect_address says."""
    pid, port = s["pid"], s["port"]
    label = {"pid": pid, "host": s["host"], "port": port}
    # a server that never listened is named where its decode would have been (0.0.0.0 and :: as
    # 127.0.0.1), so that a gate pairs it with the baseline's
    waiting = dict(label, host="127.0.0.1" if s["host"] in ("0.0.0.0", "::") else s["host"])
    if s.get("gone"):
        out["pending"].append(dict(waiting, reason=s["gone"], exited=True))
        return
    mine = [(inode, bound) for inode, bound, p in s["here"] if p == port]
    if not mine:
        other = next((inode for inode, _, p in listening if p == port), None)
        if any(p == port for _, p in s["elsewhere"]):
            why = ("its listener on port %d is in another network namespace: not reachable from here (a container's "
                   "server is tested inside it: validate --install)" % port)
        elif other is not None:
            why = "port %d is %s, not this process's or its descendants'" % (port, _listener(other, owner))
        else:
            why = "no listener on port %d of pid %d or its descendants" % (port, pid)
            out["pending"].append(dict(waiting, reason=why, exited=False))
            return
        out["refused"].append(dict(label, reason=why))
        return
    reasons = []
    for _, bound in mine:
        address, why = connect_address(bound, local)
        if address is None:
            reasons.append("its listener on port %d %s" % (port, why))
            continue
        foreign = [i for i, b, p in listening if p == port and lands(address, b) and owner.get(i) != pid]
        if foreign:
            reasons.append("a connection to %s could land on %s"
                           % (_hostport(address, port), _listener(foreign[0], owner)))
            continue
        out["targets"].append({"pid": pid, "host": address, "port": port})
        return
    out["refused"].append(dict(label, reason=reasons[0]))


def _named(servers, listening, local, owner, port, host, out):
    """The inventory's host:port: used when exactly one identified server's tree holds every
    socket a connection there may land on; servers that claim that port and hold no socket on it
    are named."""
    label = {"pid": None, "host": host, "port": port}
    address = _local(host, local)
    if address is None:
        out["refused"].append(dict(label, reason="fleetctl_sglang_host %s is not an address of this host" % host))
        return
    if not servers:
        why = "fleetctl_sglang_port %d: no SGLang server identified on this host" % port
        out["refused"].append(dict(label, reason=why))
        return
    at = _hostport(address, port)
    reach = [inode for inode, bound, p in listening if p == port and lands(address, bound)]
    first = next((owner[i] for i in reach if i in owner), None)
    other = next((i for i in reach if owner.get(i) != first), None)
    if reach and first is not None and other is None:
        out["targets"].append({"pid": first, "host": address, "port": port})
    elif reach:
        out["refused"].append(dict(label, reason="fleetctl_sglang_port %d: %s" % (port, (
            "%s is %s" % (at, NOT_IDENTIFIED) if first is None else
            "a connection to %s could land on %s" % (at, _listener(other, owner))))))
    else:
        bound = next(((i, b) for i, b, p in listening if p == port), None)
        if bound is None:
            names = ", ".join("pid %d%s" % (s["pid"], " (exited)" if s.get("gone") else "") for s in servers)
            out["pending"].append(dict(label, reason="nothing listens on %s yet (servers: %s)" % (at, names),
                                       exited=all(s.get("gone") for s in servers)))
            return
        why = "fleetctl_sglang_port %d: nothing listens on %s (port %d is bound to %s, by %s)" % (
            port, at, port, bound[1], _whose(bound[0], owner))
        out["refused"].append(dict(label, reason=why))
    holder = next((i for i, _, p in listening if p == port), None)
    for s in servers:
        if s["port"] == port and not s.get("gone") and not any(p == port for _, _, p in s["here"]):
            why = "port %d is %s, not this process's or its descendants'" % (port, _listener(holder, owner))
            out["refused"].append({"pid": s["pid"], "host": s["host"], "port": port, "reason": why})


def alive(pid):
    """Whether process `pid` runs (exists and is no zombie: /proc/PID/stat's state after the name)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _node_rank(pid):
    """The node rank process `pid`'s command line gives (topology.read; 0 when it cannot be read)."""
    return topology.read(procs.cmdline(pid) or [])["node_rank"]


def owner_refusal(pid, python, server_user=None):
    """Why server `pid` (its interpreter `python`) gets no request from fleetctl, or None: a
    server is identified by its owner as well as its socket (review R4-4). Its effective uid
    (runas.ids_of) must be root's or this probe's own (a probe not run as root: what that uid
    runs is its own already); or the inventory's fleetctl_server_user's (`server_user`, its
    uid, -1 for an account this host lacks, None: not set); or, when that is not set, the owner of the interpreter's environment
    (the directory above its bin/: the install's owner); or it runs in a system service
    (procs.service_unit: systemd put it there, as that unit's User=)."""
    ids = runas.ids_of(pid)
    if ids is None:
        return "pid %d exited" % pid
    uid = ids[0]
    if uid in (0, os.geteuid(), server_user) or procs.service_unit(pid):
        return None
    owner = None
    if server_user is None and python and os.path.isabs(python):
        try:
            owner = os.stat(os.path.dirname(os.path.dirname(python))).st_uid
        except OSError:
            owner = None
        if owner == uid:
            return None
    return ("pid %d runs as uid %d: not root, %s, and in no system service: not a server of this host's "
            "(fleetctl sends it nothing; name the servers' account in fleetctl_server_user)"
            % (pid, uid, "not fleetctl_server_user's" if server_user is not None else
               "not the owner of its interpreter's environment (%s)" % ("uid %d" % owner if owner is not None
                                                                        else "unknown")))


def _parent(pid):
    """The parent pid of `pid` (/proc/PID/stat field 4, after the name's last `)`), or None."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _descends(pid, ancestor):
    """Whether `ancestor` is `pid`'s parent, grandparent, ... (64 generations at most)."""
    for _ in range(64):
        pid = _parent(pid)
        if not pid:
            return False
        if pid == ancestor:
            return True
    return False


def _succeeds(s, sel):
    """Whether identified server `s` may be taken as the successor of gone selector `sel`: the
    same interpreter and claimed port, the same effective uid, and the same systemd service; or,
    outside one, a descendant of the gone server's parent while that parent runs (a supervisor
    that restarted it; a launcher such as `timeout` or a shell that exited with its server
    leaves the uid to decide), as far as `sel` says them (engine/gather.py SUCCESSION)."""
    if sel.get("python") is None or (s["python"], s["port"]) != (sel["python"], int(sel.get("port") or procs.DEFAULT_PORT)):
        return False
    if sel.get("uid") is not None and s.get("uid") != sel["uid"]:
        return False
    if sel.get("unit") is not None:
        return s.get("unit") == sel["unit"]
    ppid = sel.get("ppid")
    return ppid is None or not alive(ppid) or _descends(s["pid"], ppid)


def live(selectors):
    """The servers `selectors` name, now: [{pid, port, host, node_rank, gone}] (port, host, node_rank:
    what each one's command line claims, node_rank as topology.read reads it).
    A selector {pid, python, port, host} is a server as the facts probe identified it (pid as
    this probe sees it, python its interpreter, port and host from its argv): that process while
    it runs, else its successors (module docstring), else an entry gone with the reason.
    {"pid": None}: every server identified here as the facts probe identifies them (module
    docstring)."""
    given = {s["pid"] for s in selectors if s.get("pid") is not None}
    found, out = None, []
    for sel in selectors:
        pid = sel.get("pid")
        port = int(sel.get("port") or procs.DEFAULT_PORT)
        if pid is not None and alive(pid):
            now = [{"pid": pid, "port": port, "host": sel.get("host") or "127.0.0.1", "node_rank": _node_rank(pid),
                    "python": sel.get("python")}]
        else:
            if found is None:
                found = procs.find_servers(containers.host_view)[0]
            now = [{"pid": s["pid"], "port": s["port"], "host": s["host"], "node_rank": s["node_rank"],
                    "python": s["python"]} for s in found
                   if pid is None or (s["pid"] not in given and _succeeds(s, sel))]
            if pid is not None and not now:
                now = [{"pid": pid, "port": port, "host": sel.get("host") or "127.0.0.1", "gone": GONE % pid}]
        out += [s for s in now if s["pid"] not in {o["pid"] for o in out}]
    return out


def pick(selectors, port=None, host=None, server_user=None):
    """The targets of `selectors` (live()) as select() decides them on this host's /proc now.
    `port`, `host`: the inventory's choice; a {"pid": None} selector may carry it instead (for
    callers that pass only selectors: the collection's smoke module). `server_user`: the
    inventory's fleetctl_server_user, an account name (owner_refusal; one this host lacks
    matches no process). A live server whose owner
    owner_refusal refuses is refused, and its sockets are no identified server's. Returns
    select()'s answer, each target with the node rank its server's command line gives (live():
    "node_rank")."""
    for sel in selectors:
        if sel.get("pid") is None and port is None:
            port, host = sel.get("port"), sel.get("host")
    if server_user is not None:
        try:
            import pwd
            server_user = pwd.getpwnam(server_user).pw_uid
        except KeyError:
            server_user = -1  # an account this host lacks: nobody's servers but root's and services'
    servers, owners = [], []
    for s in live(selectors):
        why = None if s.get("gone") else owner_refusal(s["pid"], s.get("python"), server_user)
        if why:
            owners.append({"pid": s["pid"], "host": s["host"], "port": s["port"], "reason": why})
        else:
            servers.append(s)
    # the namespace's listeners are read before any tree's fds: a socket that starts listening
    # between the two reads is then "not listening yet" (pending), never a listener that no
    # identified server holds (refused) as it would be the other way round; and those closed by
    # the time the fds are read (their server exited) are dropped, for the same reason
    listening, local = listeners.listening(), listeners.local_addresses()
    kids, tables, ours = listeners.children(), {}, listeners.netns("self")
    for s in servers:
        s["here"], s["elsewhere"] = [], []
        if s.get("gone"):
            continue
        for held in listeners.held(listeners.tree(s["pid"], kids), tables).values():
            for inode, address, p, ns in held:
                if ns == ours:
                    s["here"].append((inode, address, p))
                else:
                    s["elsewhere"].append((address, p))
    still = {inode for inode, _, _ in listeners.listening()}
    listening = [x for x in listening if x[0] in still]
    picked = select(servers, listening, local, port, host)
    picked["refused"][:0] = owners
    ranks = {s["pid"]: s.get("node_rank") or 0 for s in servers}
    for t in picked["targets"]:
        t["node_rank"] = ranks.get(t["pid"], 0)
    return picked
