"""kbuild's preflight reads the GPUs as the facts probe does (probes/facts/gpus.py ARGS and parse):
a lost GPU is reported and refuses the build, not read as a healthy card or a CPU host. The
nvidia-smi here is a stand-in (this machine has no GPU) printing a recorded answer of
tests/unit/probes/gpus/ (one H200, and the same with a lost GPU in both spellings drivers print)."""

from __future__ import annotations

import os
import shlex

import pytest

from fleetctl.probes.facts import gpus
from fleetctl.probes.kernel import preflight
from helpers.probe_cases import case, text


def fake_smi(tmp_path, name: str) -> None:
    """nvidia-smi answering the probe's query with the recorded case `name`'s stdout and exit code."""
    c = case("gpus", name)
    (tmp_path / "stdout").write_text(text(c["stdout"]))
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n[ \"$1\" = '{gpus.ARGS[0]}' ] || exit 9\ncat {shlex.quote(str(tmp_path / 'stdout'))}\n"
                   f"exit {c['exit_code']}\n")
    smi.chmod(0o755)


@pytest.mark.parametrize("name", ["lost-gpu-no-space-exit-15", "lost-gpu-space-exit-0"])
def test_a_lost_gpu_is_reported_and_refuses_the_build(tmp_path, monkeypatch, name):
    fake_smi(tmp_path, name)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    facts = preflight.gather_facts()
    assert facts["gpus"] == [{"name": "NVIDIA H200", "compute_cap": "9.0"}]
    assert [e["pci_bus_id"] for e in facts["gpu_errors"]] == ["0000:18:00.0"]
    assert facts["gpu_error"].startswith("1 of 2 GPUs lost: 0000:18:00.0")
    refusals = preflight.decide(facts, ["cuda", "cpu"])["refusals"]
    assert any(r.startswith("cannot read the GPUs: 1 of 2 GPUs lost") for r in refusals), refusals


def test_healthy_gpus_give_their_arch(tmp_path, monkeypatch):
    fake_smi(tmp_path, "h200-healthy")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    facts = preflight.gather_facts()
    assert (facts["gpus"], facts["gpu_errors"], facts["gpu_error"]) == (
        [{"name": "NVIDIA H200", "compute_cap": "9.0"}], [], None)
    assert preflight.decide(facts, ["cuda"])["arch"] == "9.0"


@pytest.mark.parametrize("name,index,state", [("requires-reset", 0, "[Requires Reset]"),
                                              ("unknown-error", 0, "[Unknown Error]"),
                                              ("lost-gpu-bracketed-row", 1, "[GPU is lost]")])
def test_a_faulted_gpu_is_no_gpu_and_no_arch_and_refuses_the_build(tmp_path, monkeypatch, name, index, state):
    fake_smi(tmp_path, name)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    facts = preflight.gather_facts()
    assert all(g["compute_cap"] == "9.0" for g in facts["gpus"]), facts["gpus"]
    assert [(e["index"], e["faults"]["compute_cap"]) for e in facts["gpu_errors"]] == [(index, state)]
    verdict = preflight.decide(facts, ["cuda", "triton", "cpu"])
    assert verdict["backend"] is None and state not in (verdict["arch"] or "")
    assert any(r.startswith("cannot read the GPUs: 1 of ") and f"GPU {index} (" in r and f"compute_cap {state}" in r
               for r in verdict["refusals"]), verdict["refusals"]


def test_healthy_gpus_beside_faulted_ones_give_their_arch_and_the_build_is_refused(tmp_path, monkeypatch):
    fake_smi(tmp_path, "mixed-healthy-and-faulted")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    facts = preflight.gather_facts()
    assert facts["gpus"] == [{"name": "NVIDIA H100 80GB HBM3", "compute_cap": "9.0"}] * 2
    verdict = preflight.decide(facts, ["cuda"])
    assert verdict["arch"] == "9.0" and verdict["backend"] is None
    assert ("cannot read the GPUs: 2 of 4 GPUs faulted: GPU 2 (00000000:1A:00.0): compute_cap [Unknown Error]; "
            "GPU 3 (00000000:1B:00.0): compute_cap [N/A]") in verdict["refusals"]
