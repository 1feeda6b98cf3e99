"""Every command's human output at 80 and 120 columns (review newcomer-turn4 item 3, issue 50):
host names, change ids, run ids and paths are never cut inside, and 4 hosts' inspect fits a screen
or two. The documents are the ones a real lab recorded (tests/golden/history: inspect, status,
validate, apply --check --diff, apply, deploy kernel --check, deploy kernel, rollback, recover),
stored in a history file and printed again by the real `history show` and `history list`."""

from __future__ import annotations

import copy
import io
import json
import os
import re
from pathlib import Path

import pytest
from rich.console import Console

from fleetctl.cli import fleet as cli_fleet
from fleetctl.cli import history as cli_history
from fleetctl.history.store import Store

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "history"
DOCS = sorted(GOLDEN.glob("[0-9][0-9]-*.json"))
WIDTHS = (80, 120)
# what must stay whole: ids and paths (no space in them), as the documents hold them
WORD = re.compile(r"^(?:\d{8}T\d{6}Z-\S+|/\S{8,}|lab-\d+|[0-9a-f]{12})$")


def _command(argv: list[str]) -> str:
    return "deploy kernel" if argv[:2] == ["deploy", "kernel"] else argv[0]


def _store(path: Path, docs: list[tuple[dict, str]]) -> None:
    """Record each (recorded document, run id) as a finished run, as `fleetctl` records it."""
    s = Store.open(path)
    try:
        for rec, rid in docs:
            s.start(rid, _command(rec["argv"]), ["fleetctl", *rec["argv"]], "root", "ctl", "0.1.0",
                    rec["started_at"], os.getpid(), None)
            doc = {k: v for k, v in rec["doc"].items() if k != "hosts"}
            s.end(rid, rec["exit"], rec["ended_at"], doc, rec["doc"]["hosts"])
    finally:
        s.close()


def _rid(i: int, rec: dict) -> str:
    import time
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(rec["started_at"])) + f"-{i:06x}"


def _words(value, found: set[str]) -> set[str]:
    """The ids, hosts and paths (WORD) anywhere in a document."""
    if isinstance(value, dict):
        for v in value.values():
            _words(v, found)
    elif isinstance(value, list):
        for v in value:
            _words(v, found)
    elif isinstance(value, str):
        found.update(w.rstrip(":,;)") for w in value.split() if WORD.match(w.rstrip(":,;)")))
    return found


def _printed(monkeypatch, width: int, call) -> str:
    """What `call()` prints on the commands' stdout console at `width` columns."""
    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None)
    monkeypatch.setattr(cli_fleet, "out", console)
    monkeypatch.setattr(cli_history, "out", console)
    call()
    return buf.getvalue()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path = tmp_path_factory.mktemp("history") / "h.sqlite"
    runs = [(json.loads(p.read_text()), "") for p in DOCS]
    runs = [(rec, _rid(i, rec)) for i, (rec, _) in enumerate(runs)]
    _store(path, runs)
    return path, runs


def _whole(shown: str, words: set[str], wide: str) -> list[str]:
    """The words printed whole at full width that some line of `shown` does not hold whole."""
    lines = shown.splitlines()
    return sorted(w for w in words if w in wide and not any(w in line for line in lines))


@pytest.mark.parametrize("width", WIDTHS)
def test_no_id_host_or_path_is_cut_in_any_command_s_report(recorded, monkeypatch, width):
    path, runs = recorded
    assert {_command(rec["argv"]) for rec, _ in runs} >= {"inspect", "status", "validate", "apply", "deploy kernel",
                                                         "rollback", "recover"}
    for rec, rid in runs:
        words = _words(rec["doc"], {rid})
        show = lambda: cli_history.show(rid, history=str(path), json_out=False)  # noqa: E731
        wide = _printed(monkeypatch, 1000, show)
        shown = _printed(monkeypatch, width, show)
        assert any(w in wide for w in words - {rid}), (rec["argv"], wide)
        assert not _whole(shown, words, wide), (rec["argv"], width, _whole(shown, words, wide), shown)


@pytest.mark.parametrize("width", WIDTHS)
def test_history_list_keeps_run_and_change_ids_whole(recorded, monkeypatch, width):
    path, runs = recorded
    listed = lambda: cli_history.list_runs(history=str(path), json_out=False)  # noqa: E731
    shown = _printed(monkeypatch, width, listed)
    ids = {rid for _, rid in runs} | {rec["doc"]["change_id"] for rec, _ in runs if rec["doc"].get("change_id")}
    assert not _whole(shown, ids, _printed(monkeypatch, 1000, listed)), shown


def _four_hosts() -> list:
    """The recorded inspect of lab-01..03 and a fourth host (lab-01's facts, another release)."""
    from fleetctl.engine.context import HostResult

    rec = json.loads((GOLDEN / "01-inspect.json").read_text())
    hosts = rec["doc"]["hosts"]
    fourth = copy.deepcopy(hosts[0])
    fourth["host"] = "lab-04"
    fourth["facts"]["sglang"]["version"] = "0.5.10"
    out = []
    for h in hosts + [fourth]:
        data = {k: v for k, v in h.items() if k not in ("host", "address", "status", "error", "elapsed_s")}
        out.append(HostResult(h["host"], h["address"], h["status"], h["error"], h["elapsed_s"], data))
    return out


def test_inspect_of_four_hosts_at_80_columns_is_short_and_details_has_the_rest():
    from fleetctl.report.terminal import render_inspect

    results = _four_hosts()

    def shown(details: bool, width: int = 80) -> str:
        buf = io.StringIO()
        render_inspect(results, Console(file=buf, width=width, color_system=None), details=details)
        return buf.getvalue()

    short = shown(False)
    assert len(short.splitlines()) <= 60, short  # 264 lines before issue 50
    for h in ("lab-01", "lab-02", "lab-03", "lab-04"):
        assert h in short
    assert "0.5.10" in short and "call sites" in short
    full = shown(True)
    assert "allocator call sites —" in full and "need_sort origins —" in full
    assert "allocator call sites —" not in short
    for width in WIDTHS:
        lines = shown(True, width).splitlines()
        words = _words([r.data for r in results], {r.host for r in results})
        assert not _whole("\n".join(lines), words, shown(True, 1000))
