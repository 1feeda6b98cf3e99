"""Remote probe helper: the TCP sockets processes listen on, and the addresses of their network
namespace, read from /proc (stdlib only, Python 3.8+).

A process listens on a socket when its /proc/PID/fd holds a link `socket:[INODE]` and that inode
is a line in state TCP_LISTEN of /proc/PID/net/tcp or tcp6, the tables of the process's own
network namespace (proc(5), "/proc/net/tcp"). Those lines give `local_address` as hex words: IPv4
one 32-bit word, IPv6 four, each printed as the host's integer of the address bytes (so a
little-endian host shows each word's bytes reversed), then `:` and the port in hex; `st` the TCP
state (include/net/tcp_states.h); `inode` the socket's inode. A namespace's own addresses: IPv4
the `/32 host LOCAL` entries of /proc/PID/net/fib_trie, IPv6 the lines of /proc/PID/net/if_inet6
(32 hex digits in network order, then ifindex, prefix, scope, flags, name).
"""

import ipaddress
import os
import sys

TCP_LISTEN = 0x0A  # include/net/tcp_states.h


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except (OSError, ValueError):
        return ""


def _address(word_hex, byteorder):
    """The address of a /proc/net/tcp{,6} `local_address` part: 8 (IPv4) or 32 (IPv6) hex digits,
    each group of 8 the host's integer of 4 address bytes; an IPv4-mapped IPv6 address written
    "::ffff:A.B.C.D" on every Python. Raises ValueError for anything else."""
    if len(word_hex) not in (8, 32):
        raise ValueError(word_hex)
    ip = ipaddress.ip_address(b"".join(int(word_hex[i:i + 8], 16).to_bytes(4, byteorder)
                                       for i in range(0, len(word_hex), 8)))
    mapped = getattr(ip, "ipv4_mapped", None)
    return "::ffff:%s" % mapped if mapped else str(ip)


def parse_tcp(text, byteorder=sys.byteorder):
    """[(inode, address, port, state)] of the lines of /proc/net/tcp or tcp6 text `text` (its
    header line skipped), addresses as ipaddress writes them ("127.0.0.1", "::ffff:127.0.0.1").
    `byteorder`: the host's that printed them ("little" on x86-64). Lines too short or not in
    that shape are skipped."""
    rows = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 10:
            continue
        try:
            addr, port = f[1].rsplit(":", 1)
            rows.append((int(f[9]), _address(addr, byteorder), int(port, 16), int(f[3], 16)))
        except ValueError:
            continue
    return rows


def parse_fib_trie(text):
    """The IPv4 addresses of a namespace's own in /proc/net/fib_trie text: each `|-- ADDR` line
    followed by a `/32 host LOCAL` line."""
    found, last = set(), None
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["|--"] and len(words) == 2:
            last = words[1]
        elif words == ["/32", "host", "LOCAL"] and last:
            found.add(last)
    return found


def parse_if_inet6(text):
    """The IPv6 addresses in /proc/net/if_inet6 text (first field: 32 hex digits, network order)."""
    found = set()
    for line in text.splitlines():
        words = line.split()
        try:
            found.add(str(ipaddress.IPv6Address(bytes.fromhex(words[0]))))
        except (IndexError, ValueError):
            continue
    return found


def netns(pid):
    """The network namespace of process `pid` ("net:[INODE]", its /proc/PID/ns/net link), or None
    when it cannot be read (the process is gone)."""
    try:
        return os.readlink("/proc/%s/ns/net" % pid)
    except OSError:
        return None


def local_addresses(pid="self"):
    """The addresses of process `pid`'s network namespace (fib_trie's IPv4, if_inet6's IPv6)."""
    return (parse_fib_trie(_read("/proc/%s/net/fib_trie" % pid))
            | parse_if_inet6(_read("/proc/%s/net/if_inet6" % pid)))


def parse_listening(texts, byteorder=sys.byteorder):
    """[(inode, address, port)] of every socket in state LISTEN in the /proc/net/tcp and tcp6
    texts `texts`, in their order (parse_tcp)."""
    return [(inode, addr, port) for text in texts
            for inode, addr, port, state in parse_tcp(text, byteorder) if state == TCP_LISTEN]


def listening(pid="self"):
    """[(inode, address, port)] of every TCP socket in state LISTEN in process `pid`'s network
    namespace (its /proc/PID/net/tcp, then tcp6: parse_listening)."""
    return parse_listening(_read("/proc/%s/net/%s" % (pid, name)) for name in ("tcp", "tcp6"))


def socket_inodes(pid):
    """The inodes of the sockets process `pid` holds open (its /proc/PID/fd links `socket:[N]`)."""
    try:
        fds = os.listdir("/proc/%d/fd" % pid)
    except OSError:
        return set()
    found = set()
    for fd in fds:
        try:
            link = os.readlink("/proc/%d/fd/%s" % (pid, fd))
        except OSError:
            continue
        if link.startswith("socket:[") and link.endswith("]"):
            found.add(int(link[8:-1]))
    return found


def children():
    """{ppid: [pid]} of every process (field 4 of /proc/PID/stat, after the `)` of its name)."""
    kids = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        stat = _read("/proc/%s/stat" % d)
        if ")" in stat:
            kids.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(d))
    return kids


def tree(pid, kids):
    """[pid, its descendants...] from `kids` (children())."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p not in out:
            out.append(p)
            todo += kids.get(p, [])
    return out


def held(pids, tables=None):
    """{pid: [(inode, address, port, netns)]} of the listening sockets each process of `pids`
    holds itself, each looked up in that process's own network namespace. `tables`: a dict
    {netns: listening()} kept across calls (filled here)."""
    tables = {} if tables is None else tables
    out = {}
    for pid in pids:
        ns = netns(pid)
        if ns is not None and ns not in tables:
            tables[ns] = {inode: (addr, port) for inode, addr, port in listening(pid)}
        table = tables.get(ns) or {}
        out[pid] = [(inode,) + table[inode] + (ns,) for inode in sorted(socket_inodes(pid)) if inode in table]
    return out
