"""Every recorded fact case (tests/unit/probes/<fact>/<case>.json; tests/probe_cases.py): the
probe's pure reading of the recorded output gives the recorded fact. FACTS says, per fact, what a
case records and which function of the probe reads it; adding a case is adding a JSON file."""

from __future__ import annotations

import json

import pytest

from fleetctl.probes.facts import gpus, listeners, procs, topology, units
from helpers.probe_cases import ROOT, case, cases, items, text


def _gpus(c: dict):
    """`command` (nvidia-smi's, as the probe asks it), `stdout`, `stderr` (lines), `exit_code`
    -> {gpus, gpu_errors, gpus_reason} (gpus.parse)."""
    assert c["command"] == ["nvidia-smi", *gpus.ARGS], "recorded for another query than the probe's"
    found, errors, reason = gpus.parse(text(c["stdout"]), text(c["stderr"]), c["exit_code"])
    return {"gpus": found, "gpu_errors": errors, "gpus_reason": reason}


def _units(c: dict):
    """Either `command` (`systemctl show`, as the probe asks it) and `stdout` (lines) -> its units
    (units.parse_show), or `files` {path: lines} (a unit file, then its drop-ins) -> the
    [Service] settings (units.parse_unit)."""
    if "files" in c:
        return units.parse_unit([text(lines) for lines in c["files"].values()])
    names = c["command"][c["command"].index("--") + 1:]
    assert c["command"] == units.show_argv("systemctl", names), "recorded for another query than the probe's"
    return units.parse_show(text(c["stdout"]))


def _listeners(c: dict):
    """`files` {/proc/PID/net/tcp, tcp6, fib_trie, if_inet6: lines} (any may be absent) and the
    `byteorder` of the host that printed them -> {listening: [inode, address, port] in state
    LISTEN (listeners.parse_listening), local_addresses: sorted (parse_fib_trie | parse_if_inet6)}."""
    files = {path.rsplit("/", 1)[1]: text(lines) for path, lines in c["files"].items()}
    return {"listening": listeners.parse_listening([files.get("tcp", ""), files.get("tcp6", "")], c["byteorder"]),
            "local_addresses": sorted(listeners.parse_fib_trie(files.get("fib_trie", ""))
                                      | listeners.parse_if_inet6(files.get("if_inet6", "")))}


def _procs(c: dict):
    """`files` {/proc/PID/cmdline, /proc/PID/environ: items; /proc/PID/cgroup: lines} of one
    process -> what its argv, environment and cgroup say (procs.server_fields), as find_servers
    reads them."""
    f = c["files"]
    return procs.server_fields(procs.parse_cmdline(items(f["/proc/PID/cmdline"])),
                               procs.parse_environ(items(f["/proc/PID/environ"]), {"CUDA_VISIBLE_DEVICES"}),
                               procs.parse_cgroup(text(f["/proc/PID/cgroup"])))


def _topology(c: dict):
    """A server's `argv` and the `cuda_visible_devices` it started with (None: unset) -> its layout
    (topology.read) and gpu_ids (topology.gpu_ids)."""
    layout = topology.read(c["argv"])
    return {**layout, "gpu_ids": topology.gpu_ids(layout, c["cuda_visible_devices"])}


FACTS = {"gpus": _gpus, "units": _units, "listeners": _listeners, "procs": _procs, "topology": _topology}


def test_every_fact_folder_is_read_and_every_case_says_what_it_records():
    assert sorted(p.name for p in ROOT.iterdir() if p.is_dir()) == sorted(FACTS)
    for fact in FACTS:
        assert cases(fact), f"no case of {fact}"
        for name in cases(fact):
            c = case(fact, name)
            assert c.get("about") and "fact" in c, f"{fact}/{name}.json: give `about` and `fact`"


@pytest.mark.parametrize("fact,name", [(fact, name) for fact in FACTS for name in cases(fact)])
def test_the_recorded_output_gives_the_recorded_fact(fact, name):
    c = case(fact, name)
    assert json.loads(json.dumps(FACTS[fact](c))) == c["fact"]
