"""Which sockets fleetctl's HTTP probes talk to (review N6): the reading of /proc/net/tcp, tcp6,
fib_trie and if_inet6 text recorded on a real x86-64 host, and the selection rule on it."""

import os
import socket

import pytest

from fleetctl.engine.validate import SmokeOptions, smoke_targets
from fleetctl.inventory import Host
from fleetctl.probes.facts import listeners, procs, targets

# /proc/net/tcp and tcp6 of one process that listened on 0.0.0.0:30000, 127.0.0.1:30001,
# 10.213.7.2:30002 (an address of the host), 10.213.7.250:30003 (not one: IP_FREEBIND), [::]:30004,
# [::1]:30005, [::ffff:127.0.0.1]:30006 and [fd00::2]:30007, with one connection each to 30001 and
# [::1]:30005 (state 01, ESTABLISHED), recorded as the kernel printed them (trailing blanks cut).
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:7531 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 3500038 1 000000003da37c39 100 0 0 10 0
   2: FA07D50A:7533 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 3500040 1 00000000a7761cdb 100 0 0 10 0
   3: 00000000:7530 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 3500037 1 00000000e49b9445 100 0 0 10 0
   4: 0207D50A:7532 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 3500039 1 00000000f9267549 100 0 0 10 0
  83: 0100007F:7531 0100007F:912E 01 00000000:00000000 00:00000000 00000000     0        0 3500046 1 0000000055c52741 20 0 0 10 -1
 156: 0100007F:912E 0100007F:7531 01 00000000:00000000 00:00000000 00000000     0        0 3500045 2 000000002af91a96 20 0 0 10 -1
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0000000000000000FFFF00000100007F:7536 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 3500043 1 0000000048ac8475 100 0 0 10 0
   1: 00000000000000000000000001000000:7535 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 3500042 1 00000000f79356ec 100 0 0 10 0
   2: 00000000000000000000000000000000:7534 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 3500041 1 0000000025c507ad 100 0 0 10 0
   3: 000000FD000000000000000002000000:7537 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 3500044 1 00000000b77cd9b7 100 0 0 10 0
   4: 00000000000000000000000001000000:CD78 00000000000000000000000001000000:7535 01 00000000:00000000 00:00000000 00000000     0        0 3500047 2 0000000099ffb7b3 20 0 0 10 -1
   5: 00000000000000000000000001000000:7535 00000000000000000000000001000000:CD78 01 00000000:00000000 00:00000000 00000000     0        0 3500048 1 00000000458a76a6 20 0 0 10 -1
"""
# the same host's /proc/net/fib_trie (its Main table; Local repeats it) and /proc/net/if_inet6
FIB_TRIE = """\
Main:
  +-- 0.0.0.0/0 3 0 5
     |-- 0.0.0.0
        /0 universe UNICAST
     +-- 127.0.0.0/8 2 0 2
        +-- 127.0.0.0/31 1 0 0
           |-- 127.0.0.0
              /8 host LOCAL
           |-- 127.0.0.1
              /32 host LOCAL
        |-- 127.255.255.255
           /32 link BROADCAST
     +-- 10.213.7.0/24 2 0 2
        +-- 10.213.7.0/30 2 0 2
           |-- 10.213.7.0
              /24 link UNICAST
           |-- 10.213.7.2
              /32 host LOCAL
        |-- 10.213.7.255
           /32 link BROADCAST
"""
IF_INET6 = """\
00000000000000000000000000000001 01 80 10 80       lo
fd000000000000000000000000000002 04 40 00 82     eth0
fe8000000000000000fc00fffe000001 04 40 20 80     eth0
"""
LISTENING = {3500037: ("0.0.0.0", 30000), 3500038: ("127.0.0.1", 30001), 3500039: ("10.213.7.2", 30002),
             3500040: ("10.213.7.250", 30003), 3500041: ("::", 30004), 3500042: ("::1", 30005),
             3500043: ("::ffff:127.0.0.1", 30006), 3500044: ("fd00::2", 30007)}
LOCAL = {"127.0.0.1", "10.213.7.2", "::1", "fd00::2", "fe80::fc:ff:fe00:1"}


def test_tcp_and_tcp6_lines_are_read_as_the_kernel_wrote_them():
    rows = listeners.parse_tcp(TCP, "little") + listeners.parse_tcp(TCP6, "little")
    assert {inode: (addr, port) for inode, addr, port, state in rows if state == listeners.TCP_LISTEN} == LISTENING
    established = sorted((addr, port) for _, addr, port, state in rows if state == 0x01)
    assert established == [("127.0.0.1", 30001), ("127.0.0.1", 37166), ("::1", 30005), ("::1", 52600)]
    # a big-endian host prints each 32-bit word in network order: the same socket reads the same
    assert listeners.parse_tcp("hdr\n 0: 7F000001:7531 00000000:0000 0A 0:0 0:0 0 0 0 7 1\n", "big") == [
        (7, "127.0.0.1", 30001, listeners.TCP_LISTEN)]


def test_short_or_garbled_lines_are_skipped_not_raised():
    assert listeners.parse_tcp("", "little") == []
    assert listeners.parse_tcp("header only\n", "little") == []
    garbled = "hdr\n 0: 0100007F:7531 00000000:0000 0A\n 1: zz:qq 0:0 0A 0 0 0 0 0 9\n"
    assert listeners.parse_tcp(garbled, "little") == []


def test_local_addresses_come_from_fib_trie_and_if_inet6():
    assert listeners.parse_fib_trie(FIB_TRIE) == {"127.0.0.1", "10.213.7.2"}
    assert listeners.parse_if_inet6(IF_INET6) == {"::1", "fd00::2", "fe80::fc:ff:fe00:1"}


def test_this_processs_own_listening_sockets_are_read_from_proc():
    """Live: the sockets this test process listens on, IPv4 and IPv6, found through its own
    /proc/PID/fd and its namespace's tables (listeners.held, and procs._listening_ports on it)."""
    with socket.socket() as v4, socket.socket(socket.AF_INET6) as v6:
        v4.bind(("127.0.0.1", 0))
        v6.bind(("::1", 0))
        for s in (v4, v6):
            s.listen()
        want = {(v4.getsockname()[0], v4.getsockname()[1]), ("::1", v6.getsockname()[1])}
        [(pid, held)] = listeners.held([os.getpid()]).items()
        assert pid == os.getpid() and want <= {(addr, port) for _, addr, port, _ in held}
        assert {ns for *_, ns in held} == {listeners.netns("self")}
        assert {p for _, p in want} <= set(procs._listening_ports([os.getpid()])[os.getpid()])
    assert "127.0.0.1" in listeners.local_addresses() and "::1" in listeners.local_addresses()


def server(pid, port, sockets=(), host="127.0.0.1", elsewhere=(), gone=None):
    """A server record as targets.select takes it: its claim and its tree's listeners."""
    return {"pid": pid, "port": port, "host": host, "here": [(i, *LISTENING[i]) for i in sockets],
            "elsewhere": list(elsewhere), "gone": gone}


ALL = [(i, a, p) for i, (a, p) in LISTENING.items()]


def select(servers, listening=ALL, **kw):
    return targets.select(servers, listening, LOCAL, **kw)


@pytest.mark.parametrize("inode,reached", [
    (3500037, "127.0.0.1"),   # 0.0.0.0: on loopback
    (3500038, "127.0.0.1"),   # loopback: itself
    (3500039, "10.213.7.2"),   # a specific local address: on that address
    (3500041, "::1"),         # [::]: on IPv6 loopback
    (3500042, "::1"),
    (3500043, "127.0.0.1"),   # an IPv4-mapped address: its IPv4 address
    (3500044, "fd00::2"),
])
def test_a_server_is_reached_where_its_own_socket_listens(inode, reached):
    port = LISTENING[inode][1]
    got = select([server(7, port, [inode])])
    assert got == {"targets": [{"pid": 7, "host": reached, "port": port}], "refused": [], "pending": []}


def test_a_listener_on_an_address_that_is_not_the_hosts_is_refused():
    got = select([server(7, 30003, [3500040], host="10.213.7.250")])
    assert got["targets"] == [] and got["pending"] == []
    assert got["refused"] == [{"pid": 7, "host": "10.213.7.250", "port": 30003, "reason":
                               "its listener on port 30003 is bound to 10.213.7.250, not an address of this host"}]


def test_a_port_another_process_holds_is_refused_naming_the_holder():
    real, fake = server(7, 30000, [3500037]), server(9, 30000)
    got = select([real, fake])
    assert got["targets"] == [{"pid": 7, "host": "127.0.0.1", "port": 30000}]
    assert got["refused"] == [{"pid": 9, "host": "127.0.0.1", "port": 30000, "reason":
                               "port 30000 is server pid 7's listener, not this process's or its descendants'"}]
    alone = select([fake])  # the listener belongs to no identified server
    assert alone["refused"][0]["reason"] == ("port 30000 is the listener of a process that is no identified server, "
                                             "not this process's or its descendants'")
    assert alone["targets"] == []


def test_a_connection_that_could_land_on_another_processs_socket_is_refused():
    """[::]:30004 is the server's, and an IPv4 0.0.0.0:30004 another process's (possible with
    IPV6_V6ONLY): ::1 reaches only the server, 127.0.0.1 might not, so only ::1 is used."""
    listening = ALL + [(4242, "0.0.0.0", 30004)]
    assert select([server(7, 30004, [3500041])], listening)["targets"] == [{"pid": 7, "host": "::1", "port": 30004}]
    v4only = select([server(7, 30004, [3500041])], listening, port=30004, host="127.0.0.1")
    assert v4only["targets"] == [] and v4only["refused"] == [{"pid": None, "host": "127.0.0.1", "port": 30004,
                                                              "reason": "fleetctl_sglang_port 30004: a connection to "
                                                              "127.0.0.1:30004 could land on the listener of a "
                                                              "process that is no identified server"}]


def test_nothing_listening_yet_is_pending_and_a_gone_server_says_so():
    got = select([server(7, 31000), server(8, 31001, gone=targets.GONE % 8)])
    assert got["targets"] == [] and got["refused"] == []
    assert got["pending"] == [
        {"pid": 7, "host": "127.0.0.1", "port": 31000,
         "reason": "no listener on port 31000 of pid 7 or its descendants"},
        {"pid": 8, "host": "127.0.0.1", "port": 31001,
         "reason": "pid 8 exited and no server of the same interpreter on its port has taken its place"}]


def test_a_listener_in_another_network_namespace_is_refused():
    got = select([server(7, 30000, elsewhere=[("0.0.0.0", 30000)])], [])
    assert got["refused"][0]["reason"] == ("its listener on port 30000 is in another network namespace: not "
                                           "reachable from here (a container's server is tested inside it: "
                                           "validate --install)")


def test_the_inventory_port_selects_among_the_identified_servers_sockets():
    a, b = server(7, 30000, [3500037]), server(8, 30001, [3500038])
    got = select([a, b], port=30001, host="127.0.0.1")
    assert got == {"targets": [{"pid": 8, "host": "127.0.0.1", "port": 30001}], "refused": [], "pending": []}
    # a server that claims the inventory's port but does not hold it is named
    fake = server(9, 30001)
    assert select([a, b, fake], port=30001, host="127.0.0.1")["refused"] == [
        {"pid": 9, "host": "127.0.0.1", "port": 30001,
         "reason": "port 30001 is server pid 8's listener, not this process's or its descendants'"}]
    # the inventory's host must reach the socket: 0.0.0.0 is reached on a local address too
    assert select([a], port=30000, host="10.213.7.2")["targets"] == [{"pid": 7, "host": "10.213.7.2", "port": 30000}]


@pytest.mark.parametrize("port,host,reason", [
    (30002, "127.0.0.1", "fleetctl_sglang_port 30002: nothing listens on 127.0.0.1:30002 (port 30002 is bound to "
                         "10.213.7.2, by server pid 7)"),
    (30006, "127.0.0.1", "fleetctl_sglang_port 30006: 127.0.0.1:30006 is the listener of a process that is no "
                         "identified server"),
    (30000, "10.213.7.250", "fleetctl_sglang_host 10.213.7.250 is not an address of this host"),
])
def test_an_inventory_port_no_identified_server_holds_is_refused(port, host, reason):
    got = select([server(7, 30002, [3500039])], port=port, host=host)
    assert got["targets"] == [] and got["pending"] == []
    assert got["refused"] == [{"pid": None, "host": host, "port": port, "reason": reason}]


def test_an_inventory_port_without_any_server_is_refused_and_one_not_up_yet_is_pending():
    assert select([], port=30000, host="127.0.0.1")["refused"] == [
        {"pid": None, "host": "127.0.0.1", "port": 30000,
         "reason": "fleetctl_sglang_port 30000: no SGLang server identified on this host"}]
    assert select([server(7, 31000)], [], port=31000, host="127.0.0.1")["pending"] == [
        {"pid": None, "host": "127.0.0.1", "port": 31000,
         "reason": "nothing listens on 127.0.0.1:31000 yet (servers: pid 7)"}]


def test_smoke_targets_are_the_identified_servers_not_their_argv():
    facts = {"servers": [
        {"pid": 11, "python": "/opt/venv/bin/python", "import_path": ["/srv"], "port": 30000, "host": "0.0.0.0",
         "argv": ["python", "-m", "sglang.launch_server", "--host", "10.213.7.250"]},
        {"pid": 99, "pid_in_container": 1, "python": "/venv/bin/python", "import_path": ["/"], "port": 30001,
         "host": "127.0.0.1", "root": {"runtime": "podman"}},
        {"pid": None, "pid_in_container": 5, "python": "/venv/bin/python", "import_path": ["/"], "port": 30002,
         "host": "127.0.0.1", "root": {"runtime": "podman"}}]}
    host = Host("h", {}, ())
    assert smoke_targets(host, facts, SmokeOptions()) == [
        {"pid": 11, "python": "/opt/venv/bin/python", "port": 30000, "host": "0.0.0.0"},
        {"pid": 99, "python": "/venv/bin/python", "port": 30001, "host": "127.0.0.1"}]
    # inside a container the probe sees the container's pids
    assert [t["pid"] for t in smoke_targets(host, facts, SmokeOptions(), inside=True)] == [1, 5]
    # no facts (the collection's smoke action gathers none when the inventory names the port):
    # every server the probe identifies, on the inventory's port
    named = Host("h", {"fleetctl_sglang_port": 30005}, ())
    assert smoke_targets(named, None, SmokeOptions()) == [{"pid": None, "port": 30005, "host": "127.0.0.1"}]
