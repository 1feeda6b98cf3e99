"""Fixtures the rooms share (a pytest plugin, loaded by conftest.py): the change probe's test site,
two real files of two SGLang releases planned by the real planner (tests/unit and tests/machine
apply, roll back and recover on copies of it)."""

from __future__ import annotations

import os
import py_compile
from pathlib import Path

import pytest

from fleetctl.engine.playbooks.plan import plan_host
from fleetctl.engine.playbooks.model import load_playbook
from fleetctl.probes.change import actions as change, ledger
from oracles import PLAYBOOK, host_inputs, release_file


RELS = {"0.5.23": "sglang/srt/mem_cache/kv_cache_configurator.py",
        "0.5.10": "sglang/srt/model_executor/model_runner_kv_cache_mixin.py"}


@pytest.fixture(scope="session")
def planned(tmp_path_factory):
    """The real planner's change of two real files from two releases, planned once per session
    (scanning and planning take seconds) for a site at a fixed location: ({rel: text},
    [{path relative to the site, pre_sha256, post_sha256, new_text}])."""
    files = {rel: release_file(v, rel) for v, rel in RELS.items()}
    where = tmp_path_factory.mktemp("planned") / "site"
    plan = plan_host(load_playbook(PLAYBOOK), "h", {}, *host_inputs(files, location=str(where)))
    assert plan.status == "change" and len(plan.files) == 2
    return files, [{"path": str(Path(fc.path).relative_to(where)), "pre_sha256": fc.pre_sha256,
                    "post_sha256": fc.post_sha256, "new_text": fc.new_text} for fc in plan.files]


@pytest.fixture
def site(tmp_path, planned):
    """A site-packages copy holding two real files from two releases, with bytecode and an odd mode
    (owned by whoever runs the test: another user's owner is tests/machine/test_change_probe_as_root.py).

    Returns (site dir, state dir, apply params from the real planner, {path: original bytes}).
    """
    site, state = tmp_path / "site", tmp_path / "state"
    files, changes = planned
    originals = {}
    for rel, text in files.items():
        p = site / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text.encode())
        py_compile.compile(str(p), cfile=str(p.parent / "__pycache__" / (p.stem + ".cpython-311.pyc")))
        (p.parent / "__pycache__" / "other.cpython-311.pyc").write_bytes(b"keep")
        os.chmod(p, 0o640)
        originals[str(p)] = p.read_bytes()
    params = {"action": "apply", "state_dir": str(state), "change_id": "c1", "playbook": "defrag-tier0",
              "operator": "tester", "root": str(site),
              "files": [dict(fc, path=str(site / fc["path"])) for fc in changes]}
    return site, state, params, originals


def ledger_consistent(state: Path, cid: str, want: str) -> None:
    """The ledger's last state of change `cid` is `want`, and the probe's status reads the ledger."""
    entries = ledger.read(str(state))
    assert [e["state"] for e in entries if e["change_id"] == cid][-1] == want
    assert change.main({"action": "status", "state_dir": str(state)})["ok"]
