"""Installs seen but not inspected (README "Installs and servers"): which install a change is for
when some were not inspected, the facts probe's primary install, and the message of a host whose
only SGLang is in a container (issue 30), on gathered facts as the probes return them."""

from __future__ import annotations

import pytest

from fleetctl.engine.playbooks.apply import host_side, no_install_reason, select_installs
from fleetctl.engine.gather import not_inspected
from fleetctl.errors import HostFailed
from fleetctl.probes.facts import host as facts_probe
from fleetctl.vocab import InstallStatus

HOST_INSTALL = {"id": "host:/opt/sglang/venv/lib/python3.11/site-packages/sglang", "servers": [], "scan": None,
                "sglang": {"version": "0.5.2"}}
SEEN = ("install of server pid 4242 not inspected: /home/svcd/llm/.venv/bin/python is not run as root: "
        "/home/svcd belongs to uid 1000; inspect as that user, e.g. ansible_become_user: svcd")
UNSEEN = {"id": "host:/home/svcd/llm/.venv/lib/python3.11/site-packages/sglang", "status": "not_inspected",
          "reason": SEEN, "python": "/home/svcd/llm/.venv/bin/python", "servers": [4242], "units": [], "user": "svcd"}
IDLE = {**UNSEEN, "id": "host:/home/svca/.local/share/uv/tools/sglang/lib/python3.11/site-packages/sglang",
        "servers": [], "reason": "install ... (uv tool of /home/svca) not inspected: ...", "user": "svca"}
ROOT = {"runtime": "podman", "container_id": "c" * 64, "name": "sglang-1", "image": "localhost/sglang:0.5.10",
        "image_id": "i" * 64, "pid": 777}
CONTAINER_INSTALL = {"id": "podman:sglang-1:/opt/sglang/python/sglang", "servers": [777], "root": ROOT, "scan": None}


def gathered(installs=(), unseen=(), containers=()):
    return {"facts": {"servers": [], "containers": list(containers)}, "installs": list(installs),
            "not_inspected": list(unseen)}


def test_the_word_is_the_probes():
    assert InstallStatus.NOT_INSPECTED == facts_probe.NOT_INSPECTED == "not_inspected"


def test_a_server_whose_install_was_not_inspected_fails_the_change_with_its_reason():
    g = gathered([HOST_INSTALL], [UNSEEN])
    with pytest.raises(HostFailed, match="^install of server pid 4242 not inspected: .*ansible_become_user: svcd$"):
        select_installs(g)
    with pytest.raises(HostFailed, match="ansible_become_user: svcd"):
        select_installs(g, UNSEEN["id"])
    assert select_installs(g, HOST_INSTALL["id"]) == [HOST_INSTALL]  # named: the other install is changed


def test_an_idle_install_not_inspected_counts_as_an_install():
    with pytest.raises(HostFailed, match="uv tool of /home/svca"):
        select_installs(gathered([], [IDLE]))  # the only install seen: never "sglang is not installed"
    with pytest.raises(HostFailed, match=r"^2 installs and no server: name one with --install \(host:/opt/.*, "
                                         r"host:/home/svca/.* \(not inspected\)\)$"):
        select_installs(gathered([HOST_INSTALL], [IDLE]))
    served = {**HOST_INSTALL, "servers": [10]}
    assert select_installs(gathered([served], [IDLE])) == [served]  # a server's install is chosen as before


def test_containers_not_entered_are_not_inspected():
    note = "not entered: no docker on the host's PATH; fleetctl_container_exec: nsenter enters it ..."
    hung = {"kind": "container", "root": {**ROOT, "runtime": "docker"}, "servers": [777], "python": "/usr/bin/python3",
            "entered_with": "docker", "error": "entering docker:sglang-1: with docker: did not answer within 30 s"}
    found = [{"kind": "container", "root": ROOT, "servers": [777], "python": "/venv/bin/python", "entered_with": None,
              "note": note},
             {"kind": "foreign", "root": {**ROOT, "container_id": None, "pid": 888}, "servers": [888], "python": None,
              "entered_with": None, "note": "not entered: pid 888 is no container's: its cgroup (/) names no container runtime"},
             hung,
             {**hung, "error": None, "root": {**ROOT, "pid": 999}, "servers": [999]},  # entered: inspected
             {"kind": "container", "root": ROOT, "servers": [5]}]  # nobody asked to enter it (the collection)
    got = not_inspected(gathered(containers=found))
    assert [(e["id"], e["status"], e["servers"], e["reason"]) for e in got] == [
        (None, "not_inspected", [777], f"install of server pid 777 in container sglang-1 (podman) not inspected: {note}"),
        (None, "not_inspected", [888], "install of server pid 888 in its own mount namespace not inspected: not entered: "
                                       "pid 888 is no container's: its cgroup (/) names no container runtime"),
        (None, "not_inspected", [777], "install of server pid 777 in container sglang-1 (docker) not inspected: "
                                       "entering docker:sglang-1: with docker: did not answer within 30 s"),
    ]
    with pytest.raises(HostFailed, match="did not answer within 30 s"):
        select_installs(host_side(gathered(containers=found)))


def test_a_host_whose_sglang_is_only_in_a_container_says_what_install_would_do():
    g = host_side(gathered([CONTAINER_INSTALL], containers=[{"kind": "container", "root": ROOT, "servers": [777],
                                                             "entered_with": "podman", "error": None}]))
    assert select_installs(g) == []
    why = no_install_reason(g)
    assert why == (
        "not applicable without --install: sglang here is only in containers: podman:sglang-1:/opt/sglang/python/sglang "
        "(container sglang-1, image localhost/sglang:0.5.10); --install podman:sglang-1:/opt/sglang/python/sglang changes "
        "it inside its container, a change that lasts until the container is recreated (the change is in the "
        "container's writable layer, not its image): add --export-patch DIR to bake it into the image instead")
    # facts gathered without entering containers (the collection's inspect module): the container, by name
    seen = gathered(containers=[{"kind": "container", "root": ROOT, "servers": [777]}])
    assert select_installs(host_side(seen)) == []
    assert no_install_reason(host_side(seen)).startswith(
        "not applicable without --install: sglang here is only in containers: container sglang-1 (podman, image "
        "localhost/sglang:0.5.10, server pid 777), not entered here; `fleetctl apply PLAYBOOK HOST --install ID`")
    assert no_install_reason(host_side(gathered())) is None  # nothing seen: the playbook's requires say why


def test_the_primary_install_is_never_an_idle_one_beside_a_server_not_inspected():
    servers = [{"pid": 4242, "install": None}]
    assert facts_probe.primary([HOST_INSTALL], servers, [UNSEEN]) == (None, SEEN)
    assert facts_probe.primary([], [], [IDLE, {**IDLE, "id": "x"}]) == (
        None, IDLE["reason"] + "; 1 more not inspected: see not_inspected")
    assert facts_probe.primary([HOST_INSTALL], [], [IDLE]) == (None, facts_probe.SEVERAL)
    assert facts_probe.primary([HOST_INSTALL], [], []) == (HOST_INSTALL, None)
    assert facts_probe.primary([], [], []) == (None, facts_probe.NONE_FOUND)
