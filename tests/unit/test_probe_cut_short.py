"""A probe answer that ends early (issue 49): the error names the host, the probe, the bytes
received and the controller's limit, never only "not JSON" (probes.parse_output, context.cut_short)."""

from __future__ import annotations

import json

import pytest

from fleetctl import probes
from fleetctl.connection.base import OUTPUT_MAX
from fleetctl.engine.context import cut_short


def test_an_answer_killed_while_written_names_host_probe_bytes_and_limit():
    # an answer cut where the issue saw it: inside a string, past 256 KiB
    whole = b"\n" + probes.result.MARKER.encode() + b"\n" + json.dumps({"sources": {"a.py": "x" * 300000}}).encode()
    cut = whole[:257593]
    with pytest.raises(probes.CutShort) as got:
        probes.parse_output(cut, b"Terminated\x1b[2J", 124)
    e = got.value
    assert (e.size, e.exit_code) == (len(cut), 124)
    said = cut_short("lab-\x1b]0;x\x07", "facts.host", e)
    assert said.startswith("the facts.host probe's answer from 'lab-\\x1b]0;x\\x07' ended early: "
                           f"{len(cut)} bytes of output received, under fleetctl's limit of {OUTPUT_MAX} bytes")
    assert "exit status 124; stderr ends: Terminated\\x1b[2J" in said and "Unterminated string" in said
    assert said.isprintable()


def test_a_whole_answer_is_no_error():
    out = b"noise\n" + probes.result.MARKER.encode() + b"\n" + json.dumps({"ok": True}).encode()
    assert probes.parse_output(out, b"", 0) == {"ok": True}
