"""Which sockets fleetctl's HTTP probes talk to (review N6): the selection rule on the sockets and
addresses of /proc/net/tcp, tcp6, fib_trie and if_inet6 recorded on a real x86-64 host (their
reading: tests/unit/probes/listeners/x86-64-one-process.json, test_fact_fixtures.py)."""

import os
import socket

import pytest

from fleetctl.engine.validate import SmokeOptions, smoke_targets
from fleetctl.inventory import Host
from fleetctl.probes.facts import listeners, procs, targets
from helpers.probe_cases import case

# one process that listened on 0.0.0.0:30000, 127.0.0.1:30001, 10.213.7.2:30002 (an address of
# the host), 10.213.7.250:30003 (not one: IP_FREEBIND), [::]:30004, [::1]:30005,
# [::ffff:127.0.0.1]:30006 and [fd00::2]:30007: {inode: (address, port)}, and the host's addresses
RECORDED = case("listeners", "x86-64-one-process")["fact"]
LISTENING = {inode: (addr, port) for inode, addr, port in RECORDED["listening"]}
LOCAL = set(RECORDED["local_addresses"])


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
         "reason": "no listener on port 31000 of pid 7 or its descendants", "exited": False},
        {"pid": 8, "host": "127.0.0.1", "port": 31001,
         "reason": "pid 8 exited and no server of the same interpreter on its port has taken its place",
         "exited": True}]


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
         "reason": "nothing listens on 127.0.0.1:31000 yet (servers: pid 7)", "exited": False}]
    # the inventory's port, when every server that could listen there has exited
    assert select([server(7, 31000), server(8, 31000, gone=targets.GONE % 8)], [], port=31000,
                  host="127.0.0.1")["pending"][0]["exited"] is False
    assert select([server(8, 31000, gone=targets.GONE % 8)], [], port=31000, host="127.0.0.1")["pending"] == [
        {"pid": None, "host": "127.0.0.1", "port": 31000,
         "reason": "nothing listens on 127.0.0.1:31000 yet (servers: pid 8 (exited))", "exited": True}]


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


def test_a_socket_that_starts_listening_during_the_scan_is_pending_not_refused(monkeypatch):
    """Live, the race a restarted server runs with the gate's poll (seen in CI): its socket starts
    listening after pick() scanned the server's fds. pick() read the namespace's listeners first,
    so the socket is "not listening yet" (pending, asked again); read after the scan, it would be
    a listener no identified server holds, refused for good."""
    real = listeners.held
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

        def held_then_listen(pids, tables=None):
            found = real(pids, tables)
            s.listen()
            return found

        monkeypatch.setattr(listeners, "held", held_then_listen)
        me = {"pid": os.getpid(), "python": "/usr/bin/python3", "port": port, "host": "127.0.0.1"}
        picked = targets.pick([me], port=port, host="127.0.0.1")
        assert picked["refused"] == [] and picked["targets"] == []
        assert [p["reason"] for p in picked["pending"]] == [
            f"nothing listens on 127.0.0.1:{port} yet (servers: pid {os.getpid()})"]
        # asked again, it is this process's socket
        monkeypatch.setattr(listeners, "held", real)
        assert targets.pick([me], port=port, host="127.0.0.1")["targets"] == [
            {"pid": os.getpid(), "host": "127.0.0.1", "port": port, "node_rank": 0}]


def test_a_socket_that_closes_during_the_scan_is_pending_not_refused(monkeypatch):
    """Live, the mirror race (seen in the fleet test of soak finding 11): the server exits, and
    its socket closes, after pick() read the namespace's listeners and before it scanned the
    server's fds. Its socket is read again after the scan and dropped, so nothing is "a listener
    no identified server holds" (refused: the gate would fail on a wrong reason)."""
    real = listeners.held
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]

    def close_then_held(pids, tables=None):
        s.close()
        return real(pids, tables)

    monkeypatch.setattr(listeners, "held", close_then_held)
    me = {"pid": os.getpid(), "python": "/usr/bin/python3", "port": port, "host": "127.0.0.1"}
    picked = targets.pick([me], port=port, host="127.0.0.1")
    assert picked["refused"] == [] and picked["targets"] == []
    assert [p["reason"] for p in picked["pending"]] == [
        f"nothing listens on 127.0.0.1:{port} yet (servers: pid {os.getpid()})"]
