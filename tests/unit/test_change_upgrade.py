"""An upgrade under an applied change (issue 49, case 05), on a tree built in tmp as pip leaves
it: `pip install -U` removes exactly the files of the old release's RECORD, writes the new
release's and its dist-info, and leaves a file the change created (in no RECORD) behind. The
change probe's status names the upgrade, rollback refuses with and without force (never writing
0.5.10's file into 0.5.23), `forget` checks the tree, removes the left-behind file and records the
change superseded; a change on an unchanged release is never forgotten."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from fleetctl.probes.change import actions, ledger

from test_distinfo import install, sglang_files

HOOK = "sglang/srt/layers/attention/fleetctl_verify.py"
RUNNER = "sglang/srt/model_executor/model_runner.py"


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def applied(tmp_path: Path) -> tuple[Path, str, dict]:
    """0.5.10 in tmp_path/site with change "c1" applied: model_runner.py edited, the hook created."""
    site = install(tmp_path / "site", "0.5.10", None)
    state = str(tmp_path / "state")
    old = (site / RUNNER).read_text()
    new, hook = old.replace("NEED_SORT = False", "NEED_SORT = True"), "# written by fleetctl route-verify-attention\n"
    (site / HOOK).parent.mkdir(parents=True, exist_ok=True)
    r = actions.main({"action": "apply", "state_dir": state, "change_id": "c1", "playbook": "defrag-tier0",
                      "root": str(site / "sglang"), "files": [
                          {"path": str(site / HOOK), "pre_sha256": None, "post_sha256": sha(hook), "new_text": hook},
                          {"path": str(site / RUNNER), "pre_sha256": sha(old), "post_sha256": sha(new), "new_text": new}]})
    assert r["ok"], r
    assert ledger.changes(state)["c1"]["release"] == {"dist": "sglang", "version": "0.5.10"}
    return site, state, r


def upgrade(site: Path, to: str) -> None:
    """What `pip install --upgrade` does: the old RECORD's files and dist-info removed, the new written."""
    for d in site.glob("sglang-*.dist-info"):
        for line in (d / "RECORD").read_text().splitlines():
            (site / line.split(",")[0]).unlink(missing_ok=True)
        shutil.rmtree(d, ignore_errors=True)
    install(site, to, None)


def test_status_names_the_upgrade_and_rollback_refuses_even_forced(tmp_path):
    site, state, _ = applied(tmp_path)
    upgrade(site, "0.5.23")
    st = actions.main({"action": "status", "state_dir": state, "host": "edge-9", "location": str(site)})
    assert st["changes"][0]["upgraded"] == {"dist": "sglang", "from": "0.5.10", "to": "0.5.23"}
    assert {d["path"]: d["problem"] for d in st["drift"]} == {
        str(site / HOOK): "replaced by an upgrade of sglang (0.5.10 -> 0.5.23): the change is gone with the old "
                          "release; this file it created is left behind, removed by `fleetctl rollback --forget c1 "
                          "edge-9`, then apply defrag-tier0 again",
        str(site / RUNNER): "replaced by an upgrade of sglang (0.5.10 -> 0.5.23): the change is gone with the old "
                            "release; drop its entry with `fleetctl rollback --forget c1 edge-9`, then apply "
                            "defrag-tier0 again"}
    assert (st["modified"], st.get("metadata_warning")) == ([], None)  # 0.5.23's files are exactly 0.5.23's
    runner = (site / RUNNER).read_text()
    for force in (False, True):
        r = actions.main({"action": "rollback", "state_dir": state, "change_id": "c1", "force": force,
                          "host": "edge-9"})
        assert r["refused"] and r["error"] == (
            f"change c1 was applied to sglang 0.5.10 and {site / 'sglang'} is now sglang 0.5.23 (replaced by an "
            "upgrade of sglang (0.5.10 -> 0.5.23)): a rollback would write 0.5.10's files into 0.5.23, with or "
            "without --force. Drop the stale entry with `fleetctl rollback --forget c1 edge-9` (it checks the tree "
            "first), then apply defrag-tier0 again")
        assert (site / RUNNER).read_text() == runner
    r = actions.main({"action": "rollback", "state_dir": state, "last": True, "force": True})
    assert r["refused"] and "`fleetctl rollback --forget c1 HOST`" in r["error"]


def test_forget_checks_the_tree_removes_the_left_file_and_records_superseded(tmp_path):
    site, state, _ = applied(tmp_path)
    r = actions.main({"action": "forget", "state_dir": state, "change_id": "c1"})
    assert r["refused"] and r["error"] == (f"change c1 is not stale: {site / 'sglang'} is still sglang 0.5.10 as it "
                                           "was applied to (roll it back instead)")
    assert (site / HOOK).exists() and ledger.changes(state)["c1"]["state"] == "applied"
    upgrade(site, "0.5.23")
    runner = (site / RUNNER).read_text()
    r = actions.main({"action": "forget", "state_dir": state, "change_id": "c1", "reason": "operator"})
    assert r == {"ok": True, "change_id": "c1", "upgraded": {"dist": "sglang", "from": "0.5.10", "to": "0.5.23"},
                 "removed": [str(site / HOOK)], "left": [], "adopted": []}
    assert not (site / HOOK).exists() and (site / RUNNER).read_text() == runner == sglang_files("0.5.23")[RUNNER]
    entry = ledger.changes(state)["c1"]
    assert entry["state"] == "superseded" and entry["reason"] == (
        f"replaced by an upgrade of sglang (0.5.10 -> 0.5.23); forgotten: nothing restored; removed the files it "
        f"created: {site / HOOK}; operator")
    st = actions.main({"action": "status", "state_dir": state, "location": str(site)})
    assert (st["drift"], st["modified"]) == ([], [])
    r = actions.main({"action": "rollback", "state_dir": state, "change_id": "c1", "force": True})
    assert r["refused"] and r["error"] == "change c1 is superseded, not applied"
    assert actions.main({"action": "rollback", "state_dir": state, "last": True}) == {
        "ok": True, "change_id": None, "nothing": "no applied change to roll back"}


def test_a_created_file_edited_since_is_left_and_named(tmp_path):
    site, state, _ = applied(tmp_path)
    upgrade(site, "0.5.23")
    (site / HOOK).write_text("# someone's own\n")
    r = actions.main({"action": "forget", "state_dir": state, "change_id": "c1"})
    assert (r["removed"], r["left"]) == ([], [str(site / HOOK)]) and (site / HOOK).read_text() == "# someone's own\n"


def test_a_created_file_a_later_change_found_in_place_is_kept_for_it(tmp_path):
    """The playbook applied again to 0.5.23 before the forget: its plan found the hook already there
    (create_file: "already applied") and edited only the release's own file; forgetting the old
    change keeps the hook, now the new change's, and says so."""
    site, state, _ = applied(tmp_path)
    upgrade(site, "0.5.23")
    old = (site / RUNNER).read_text()
    new = old.replace("NEED_SORT = False", "NEED_SORT = True")
    assert actions.main({"action": "apply", "state_dir": state, "change_id": "c2", "playbook": "defrag-tier0",
                         "root": str(site / "sglang"), "files": [{"path": str(site / RUNNER), "pre_sha256": sha(old),
                                                                  "post_sha256": sha(new), "new_text": new}]})["ok"]
    r = actions.main({"action": "forget", "state_dir": state, "change_id": "c1"})
    assert (r["removed"], r["adopted"]) == ([], [str(site / HOOK)]) and (site / HOOK).exists()
    assert f"kept for change c2, applied since: {site / HOOK}" in ledger.changes(state)["c1"]["reason"]
    st = actions.main({"action": "status", "state_dir": state, "location": str(site)})
    assert st["drift"] == [] and {c["change_id"]: c["state"] for c in st["changes"]} == {"c1": "superseded",
                                                                                          "c2": "applied"}


def test_an_entry_of_an_older_fleetctl_is_judged_by_the_record(tmp_path):
    """A ledger entry written before releases were recorded: the edited file is now exactly what
    0.5.23's RECORD says, so the change was replaced by an install; a plain edit is not."""
    site, state, _ = applied(tmp_path)
    path = Path(state) / "ledger.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({k: v for k, v in e.items() if k != "release"}) + "\n" for e in lines))
    (site / RUNNER).write_text("edited by hand\n")
    st = actions.main({"action": "status", "state_dir": state})
    assert [d["problem"] for d in st["drift"]] == ["drift: edited since the apply"]
    upgrade(site, "0.5.23")
    st = actions.main({"action": "status", "state_dir": state})
    assert st["changes"][0]["upgraded"] == {"dist": "sglang", "from": None, "to": "0.5.23"}
    assert all(d["problem"].startswith("replaced by an upgrade of sglang (a release not recorded -> 0.5.23)")
               for d in st["drift"])
    r = actions.main({"action": "rollback", "state_dir": state, "change_id": "c1", "force": True})
    assert r["refused"] and "a rollback would write the old release's files into 0.5.23" in r["error"]
