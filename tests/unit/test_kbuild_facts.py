"""kbuild's preflight reads the GPUs as the facts probe does (probes/facts/gpus.py ARGS and parse):
a lost GPU is reported and refuses the build, not read as a healthy card or a CPU host. The
nvidia-smi here is a stand-in (this machine has no GPU) printing what nvidia-smi prints with one
GPU lost (probes/facts/gpus.py cites the shapes)."""

from __future__ import annotations

import os

import pytest

from fleetctl.probes.facts import gpus
from fleetctl.probes.kernel import preflight

HEALTHY = "0, 00000000:17:00.0, NVIDIA H200, 143771, 570.86.15, 9.0"
# both spellings drivers print (NVIDIA/nvidia-container-toolkit#69 and #846: "GPU0000:65:00.0";
# NVIDIA/open-gpu-kernel-modules#387: "GPU 0000:0B:00.0")
LOST = ["Unable to determine the device handle for GPU0000:18:00.0: Unknown Error",
        "Unable to determine the device handle for GPU 0000:18:00.0: Unknown Error"]


def fake_smi(tmp_path, stdout: str, code: int) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n[ \"$1\" = '{gpus.ARGS[0]}' ] || exit 9\nprintf '%s\\n' '{stdout}'\nexit {code}\n")
    smi.chmod(0o755)


@pytest.mark.parametrize("lost", LOST, ids=["no-space", "space"])
@pytest.mark.parametrize("code", [0, 15])
def test_a_lost_gpu_is_reported_and_refuses_the_build(tmp_path, monkeypatch, code, lost):
    fake_smi(tmp_path, f"{HEALTHY}\n{lost}", code)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    facts = preflight.gather_facts()
    assert facts["gpus"] == [{"name": "NVIDIA H200", "compute_cap": "9.0"}]
    assert [e["pci_bus_id"] for e in facts["gpu_errors"]] == ["0000:18:00.0"]
    assert facts["gpu_error"].startswith("1 of 2 GPUs lost: 0000:18:00.0")
    refusals = preflight.decide(facts, ["cuda", "cpu"])["refusals"]
    assert any(r.startswith("cannot read the GPUs: 1 of 2 GPUs lost") for r in refusals), refusals


def test_healthy_gpus_give_their_arch(tmp_path, monkeypatch):
    fake_smi(tmp_path, HEALTHY, 0)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    facts = preflight.gather_facts()
    assert (facts["gpus"], facts["gpu_errors"], facts["gpu_error"]) == (
        [{"name": "NVIDIA H200", "compute_cap": "9.0"}], [], None)
    assert preflight.decide(facts, ["cuda"])["arch"] == "9.0"
