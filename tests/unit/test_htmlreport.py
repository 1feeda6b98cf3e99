"""The HTML fleet report (report/html.py, report/svg.py) from the recorded lab sequence
(tests/golden/history/): the page loads nothing and runs nothing (CSP meta, no script, no
external reference), host text is escaped and its control characters shown, the charts have one
point per measurement and per change, and the overview shows each host's latest cell."""

from __future__ import annotations

import base64
import copy
import dataclasses
import hashlib
import random
import re
from html.parser import HTMLParser

import pytest

from fleetctl.report import html as report_html
from fleetctl.history.model import HostRecord
from report_runs import recorded_runs, write_store

NOW = 1796190000.0
HOSTILE = "<img src=http://192.0.2.1/x>\x1b[31mred\x1b[0m\"><script>alert(1)</script>"


class Page(HTMLParser):
    """The parsed page: every start tag with its attributes, the text (HTML entities decoded) and
    the style element's content."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self.style = ""
        self._in: list[str] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        if self._in and self._in[-1] == tag:
            self._in.pop()

    def handle_data(self, data):
        if self._in and self._in[-1] == "style":
            self.style += data
        self.text.append(data)

    def all(self, tag: str, cls: str | None = None) -> list[dict]:
        return [a for t, a in self.tags if t == tag and (cls is None or cls in (a.get("class") or "").split())]


@pytest.fixture(scope="module")
def runs():
    return recorded_runs()


@pytest.fixture(scope="module")
def page(runs):
    return Page(report_html.render(runs, NOW, "7d", "/x/history.sqlite"))


def by_name(runs, suffix):
    return next(r for r in runs if r.run_id.endswith(suffix))


def test_the_page_loads_nothing_and_runs_nothing(page):
    metas = page.all("meta")
    csp = [m for m in metas if (m.get("http-equiv") or "").lower() == "content-security-policy"]
    assert len(csp) == 1
    before = [t for t, _ in page.tags[:page.tags.index(("meta", csp[0]))]]
    assert before == ["html", "head", "meta"], "the CSP meta comes first in <head>, after the charset"
    policy = dict(d.strip().split(" ", 1) for d in csp[0]["content"].split(";"))
    assert policy["default-src"] == "'none'"
    digest = base64.b64encode(hashlib.sha256(page.style.encode()).digest()).decode()
    assert policy["style-src"] == f"'sha256-{digest}'"  # the one style element, by its hash
    assert policy["base-uri"] == "'none'" and policy["form-action"] == "'none'"
    assert not page.all("script") and not page.all("link") and not page.all("img") and not page.all("iframe")
    refs = [(t, k, v) for t, a in page.tags for k, v in a.items()
            if k in ("src", "href", "xlink:href", "action", "srcset", "poster", "data") and not v.startswith("#")]
    assert refs == [], "only links inside the page"
    assert not [(t, k) for t, a in page.tags for k in a if k.startswith("on")], "no event handler"
    assert "url(" not in page.style and "@import" not in page.style


def test_every_host_run_and_change_id_is_shown(runs, page):
    text = "".join(page.text)
    assert [a["data-host"] for a in page.all("tr", "host-row")] == ["lab-01", "lab-02", "lab-03"]
    assert [a["data-run"] for a in page.all("section", "run")] == [r.run_id for r in reversed(runs)]
    shown = [(a["data-host"], a["data-status"]) for a in page.all("tr", "host-result")]
    assert shown == [(h.host, h.status) for r in reversed(runs) for h in r.hosts]
    cids = {r.doc["change_id"] for r in runs if r.doc.get("change_id")}
    assert len(cids) == 2 and all(c in text for c in cids)
    assert "need_sort = True  # fleetctl defrag-tier0" in text  # the apply's diff
    assert "0.5.2 wheel host:/opt/sglang/venv/lib/python3.11/site-packages/sglang" in text


def test_host_text_is_escaped_and_its_control_characters_shown(runs):
    bad = copy.deepcopy(runs)
    status = by_name(bad, "-11")
    h = status.hosts[1]
    h.doc["installs"][0]["id"] = HOSTILE
    status.hosts[1] = dataclasses.replace(h, host=HOSTILE, error=HOSTILE)
    apply = by_name(bad, "-06")
    apply.hosts[0].doc["plan"]["files"][0]["diff"] = HOSTILE + "\n"
    html = report_html.render(bad, NOW)
    parsed = Page(html)
    assert not parsed.all("img") and not parsed.all("script"), "host text made no element"
    assert "\x1b" not in html, "no raw terminal escape reaches the page"
    shown = HOSTILE.replace("\x1b", "\\x1b")
    text = "".join(parsed.text)
    assert text.count(shown) >= 4  # the host name (overview, run, timeline), its error, install id, diff
    assert "&lt;img src=http://192.0.2.1/x&gt;" in html
    assert [a["data-host"] for a in parsed.all("tr", "host-row")][-1] == shown


def _values(doc: dict, phase: str) -> dict:
    row = doc["load_gate"]["servers"][0]
    return {k: pytest.approx(float(f"{row[phase][k]:.6g}")) for k in ("output_throughput", "p99_ttft_ms", "p99_itl_ms")}


def test_load_gate_charts_have_a_bar_per_run_and_metric(runs, page):
    apply = by_name(runs, "-06")
    gated = [h for h in apply.hosts if h.doc.get("load_gate")]
    assert [h.host for h in gated] == ["lab-01", "lab-02"]
    bars = page.all("rect", "point")
    assert len(bars) == 2 * 3 * len(gated)
    for n, h in enumerate(gated):
        mine = bars[6 * n:6 * n + 6]
        for phase in ("baseline", "after"):
            got = {b["data-metric"]: float(b["data-value"]) for b in mine if b["data-phase"] == phase}
            assert got == _values(h.doc, phase)
    verdicts = [b["class"] for b in bars if b["data-phase"] == "after"]
    assert verdicts == ["point after ok"] * 3 + ["point after breach"] * 3  # lab-02 breached all three


def test_the_timeline_has_a_point_per_change_made(runs, page):
    dots = page.all("circle", "point")
    made = [(h.host, h.status) for r in runs if r.command in report_html.CHANGING and not r.doc.get("check")
            for h in r.hosts]
    # the apply, the kernel's deploy, its rollback, a recover that found nothing pending
    assert made == [("lab-01", "changed"), ("lab-02", "failed"), ("lab-03", "skipped"), ("lab-01", "changed"),
                    ("lab-01", "changed"), ("lab-01", "ok"), ("lab-02", "ok"), ("lab-03", "ok")]
    assert [(d["data-host"], d["data-status"]) for d in dots] == made


def test_the_overview_shows_each_hosts_latest_cell(runs):
    rows = {host: cells for host, cells, _ in report_html.overview(runs)}
    titles = [c[0] for c in report_html.COLUMNS]
    lab01 = dict(zip(titles, rows["lab-01"]))
    assert lab01["SGLang installs"].run_id.endswith("-15")  # the last status, after the last inspect
    assert lab01["SGLang installs"].lines == ["0.5.2 wheel host:/opt/sglang/venv/lib/python3.11/site-packages/sglang"]
    assert lab01["applied changes"].run_id.endswith("-15")
    defrag = by_name(runs, "-06").doc["change_id"]
    assert lab01["applied changes"].lines == [f"{defrag} (defrag-tier0)"]  # the kernel was rolled back (-13)
    assert lab01["active kernels"].lines == ["none"]
    kernel = by_name(runs, "-09").hosts[0].doc["build_key"]
    older = dict(zip(titles, {h: c for h, c, _ in report_html.overview(runs[:12])}["lab-01"]))  # before its rollback
    assert older["active kernels"].lines == [f"verify_attention {kernel[:12]}"]
    assert older["active kernels"].run_id.endswith("-11")
    assert lab01["drift"].status == "failed" and "edited since the apply" in lab01["drift"].lines[0]
    assert lab01["last validation"].run_id.endswith("-10") and "load smoke: 4 of 4" in lab01["last validation"].lines[1]
    shuffled = runs[:]
    random.Random(1).shuffle(shuffled)
    assert report_html.overview(shuffled) == report_html.overview(runs), "by start time, not by the list's order"


def test_a_later_run_without_the_data_keeps_the_older_cell(runs):
    status = by_name(runs, "-15")
    down = dataclasses.replace(status, run_id="later", started_at=status.started_at + 3600, ended_at=None,
                               hosts=[HostRecord("lab-02", "10.213.33.12", "unreachable", "connect timed out", 2.0,
                                                 {"host": "lab-02", "status": "unreachable"})])
    rows = {host: (cells, last) for host, cells, last in report_html.overview(runs + [down])}
    cells, last = rows["lab-02"]
    assert cells[1].run_id == status.run_id and cells[1].lines == ["none"]
    assert (last.run_id, last.status) == ("later", "unreachable")
    assert last.lines == ["status unreachable", "connect timed out"]


def test_a_report_from_the_store_is_the_report_of_its_runs(runs, tmp_path):
    from fleetctl.history.store import Store

    store = Store.open(write_store(tmp_path / "h.sqlite", runs))
    try:
        stored = store.runs()
    finally:
        store.close()
    assert report_html.render(stored, NOW) == report_html.render(runs, NOW)


def test_no_runs_still_renders():
    page = Page(report_html.render([], NOW, "7d"))
    text = "".join(page.text)
    assert "No runs recorded in the last 7d." in text and "No change was made" in text
    assert not page.all("svg")


def test_the_page_is_deterministic(runs):
    assert report_html.render(runs, NOW) == report_html.render(copy.deepcopy(runs), NOW)


def test_the_command_writes_the_report_of_the_history_file(runs, tmp_path):
    import os
    import subprocess
    import sys

    history = write_store(tmp_path / "h.sqlite", runs)
    out = tmp_path / "fleet.html"

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "fleetctl.cli", "report", "-o", str(out),
                               "--history", str(history), *args], capture_output=True, text=True)

    r = cli()
    assert r.returncode == 0, r.stderr
    assert f"report written: {out} (15 run(s), 3 host(s), from {history})" in r.stderr
    assert os.stat(out).st_mode & 0o777 == 0o600
    page = Page(out.read_text())
    assert [a["data-run"] for a in page.all("section", "run")] == [r.run_id for r in reversed(runs)]
    assert cli("--since", "1s").returncode == 0  # the recorded runs are older than a second
    assert Page(out.read_text()).all("section", "run") == []
    bad = cli("--since", "3x")
    assert bad.returncode == 5 and "--since 3x" in bad.stderr


def test_odd_host_data_renders_what_it_has(runs, tmp_path):
    """A figure too large for a float (10**400), a lone surrogate (an undecodable file name, as
    os.fsdecode gives it) in a drift path and an error, gate checks of an older shape (no target,
    no detail) and a run whose document is null: each run shows what it has, and the file is
    written (red-team review of issue 37, M1)."""
    from fleetctl.history.store import Store

    bad = copy.deepcopy(runs)
    apply = by_name(bad, "-06")
    gate = apply.hosts[0].doc["load_gate"]
    gate["servers"][0]["after"]["output_throughput"] = 10 ** 400
    gate["servers"][0]["limits"]["p99_ttft_ms"] = 10 ** 400
    gate["checks"] = [{"name": "load-throughput"}, {"passed": True}] + gate["checks"]
    status = by_name(bad, "-15")
    status.hosts[0].doc["drift"][0]["path"] = "/opt/x/\udcff.py"
    status.hosts[1] = dataclasses.replace(status.hosts[1], error="cannot read /opt/\udcfe")
    validate = by_name(bad, "-10")
    validate.hosts[0].doc["load"]["servers"][0]["load"]["p99_ttft_ms"] = 10 ** 400
    validate.hosts[0].doc["servers"][0]["e2e_latency_s"] = 10 ** 400
    bad.append(dataclasses.replace(by_name(bad, "-01"), run_id="null-doc", doc=None,
                                   started_at=max(r.started_at for r in bad) + 1))
    html = report_html.render(bad, NOW)
    page = Page(html)
    assert [a["data-run"] for a in page.all("section", "run")][0] == "null-doc"
    text = "".join(page.text)
    assert "/opt/x/\\udcff.py" in text and "cannot read /opt/\\udcfe" in text
    assert "not measured" in text  # the 10**400 figures
    assert "could not be shown" not in text, "every run's section shows what it has"
    assert "load-throughput" in text  # the check of an older shape
    store = Store.open(write_store(tmp_path / "h.sqlite", bad))
    store.close()
    out = tmp_path / "fleet.html"
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "fleetctl.cli", "report", "-o", str(out), "--history",
                        str(tmp_path / "h.sqlite")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "\\udcff" in out.read_text()


def test_a_run_the_template_cannot_show_is_named_and_the_rest_shown(runs, monkeypatch):
    """An elapsed time that is not a number is not measured; a run whose section still breaks
    (broken here on purpose) shows as a section that says so; the other runs are shown in full."""
    bad = copy.deepcopy(runs)
    apply = by_name(bad, "-06")
    apply.hosts[0] = dataclasses.replace(apply.hosts[0], elapsed_s="soon")
    assert '<td>not measured</td>' in report_html.render(bad, NOW)
    diffs = report_html._diffs

    def breaks(run):
        if run.run_id == apply.run_id:
            raise RuntimeError("a shape no reader knows")
        return diffs(run)

    monkeypatch.setattr(report_html, "_diffs", breaks)
    page = Page(report_html.render(bad, NOW))
    assert [a["data-run"] for a in page.all("section", "run")] == [r.run_id for r in reversed(bad)]
    text = "".join(page.text)
    assert f"run {apply.run_id}: its record could not be shown" in text
    assert "0.5.2 wheel host:/opt/sglang/venv/lib/python3.11/site-packages/sglang" in text


def test_non_finite_and_negative_figures_draw_no_bar(runs):
    """NaN and infinite load figures are not measured (no panel), a negative one draws at 0, and
    a label of 1e308 is short (red-team review of issue 37, L3)."""
    bad = copy.deepcopy(runs)
    row = by_name(bad, "-06").hosts[0].doc["load_gate"]["servers"][0]
    row["baseline"].update(output_throughput=float("nan"), p99_ttft_ms=-5.0, p99_itl_ms=1e308)
    row["after"].update(output_throughput=12.0, p99_ttft_ms=float("inf"), p99_itl_ms=2.0)
    row["limits"].update(p99_itl_ms=float("-inf"))
    html = report_html.render(bad, NOW)
    svg = html[html.index('<h2 id="gates">'):html.index('<h2 id="runs">')]
    assert "nan" not in svg.lower() and "inf" not in svg.lower()
    bars = [b for b in Page(svg).all("rect", "point")]
    assert len(bars) == 2 + 6  # lab-01: only p99 ITL is measured by both runs; lab-02 in full
    assert all(float(b["height"]) >= 0 and float(b["y"]) <= report_html.svg.PANEL_H for b in bars)
    assert "1e+308 ms" in svg and not re.search(r"[0-9]{20}", svg)


def test_long_host_strings_are_cut_with_a_pointer_to_the_run(runs):
    """A 2 MB host error and a 2 MB diff are shown to their first 4 KiB with how much is left and
    where to read it; the page stays small (red-team review of issue 37, L4)."""
    bad = copy.deepcopy(runs)
    apply = by_name(bad, "-06")
    apply.hosts[1] = dataclasses.replace(apply.hosts[1], error="E" * 2_000_000)
    apply.hosts[0].doc["plan"]["files"][0]["diff"] = "+" + "D" * 2_000_000 + "\n"
    html = report_html.render(bad, NOW)
    assert len(html) < 300_000
    text = "".join(Page(html).text)
    assert f"more characters; fleetctl history show {apply.run_id}" in text
    assert "E" * report_html.CAP not in text and "E" * 1000 in text


def test_the_report_goes_to_stdout_a_device_or_a_fifo_without_replacing_it(runs, tmp_path):
    """`-o -` and `-o STDOUT` (a link to /proc/self/fd/1, as /dev/stdout is: made here, so a
    regression replaces this link, not the machine's) write the page to standard output, a FIFO is
    written through; a symlink to a file is refused, named, and left as it is (red-team review of
    issue 37, L2)."""
    import os
    import subprocess
    import sys
    import threading

    history = write_store(tmp_path / "h.sqlite", runs)
    cwd = tmp_path / "cwd"
    cwd.mkdir()

    def cli(out):
        return subprocess.run([sys.executable, "-m", "fleetctl.cli", "report", "-o", out, "--history", str(history)],
                              capture_output=True, text=True, cwd=cwd)

    stdout = tmp_path / "stdout"
    stdout.symlink_to("/proc/self/fd/1")
    for out in ("-", str(stdout)):
        r = cli(out)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("<!DOCTYPE html>") and "report written: standard output" not in r.stdout
    assert stdout.is_symlink() and os.readlink(stdout) == "/proc/self/fd/1" and not os.listdir(cwd)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    r = cli(str(fifo))
    reader.join(30)
    assert r.returncode == 0, r.stderr
    assert got[0].startswith("<!DOCTYPE html>") and fifo.is_fifo()
    target = tmp_path / "kept.txt"
    target.write_text("kept\n")
    link = tmp_path / "fleet.html"
    link.symlink_to(target)
    r = cli(str(link))
    assert r.returncode == 5 and f"{link} is a symbolic link" in r.stderr
    assert link.is_symlink() and target.read_text() == "kept\n"


def test_the_command_shows_the_newest_runs_by_default(runs, tmp_path):
    """Without --since or --runs the page holds the newest DEFAULT_RUNS runs, and says so."""
    import subprocess
    import sys

    from fleetctl.cli import htmlreport

    history = write_store(tmp_path / "h.sqlite", runs)
    out = tmp_path / "fleet.html"

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "fleetctl.cli", "report", "-o", str(out), "--history",
                               str(history), *args], capture_output=True, text=True)

    assert htmlreport.DEFAULT_RUNS == 200
    r = cli("--runs", "4")
    assert r.returncode == 0, r.stderr
    page = Page(out.read_text())
    assert [a["data-run"] for a in page.all("section", "run")] == [r.run_id for r in reversed(runs)][:4]
    assert "the newest 4 of 15 runs" in "".join(page.text)


def _cells(runs, host):
    titles = [c[0] for c in report_html.COLUMNS]
    return dict(zip(titles, {h: c for h, c, _ in report_html.overview(runs)}[host]))


def test_a_rollback_after_the_last_status_drops_the_change_from_the_overview(runs):
    """Issue 50: a change rolled back after the last status showed as applied until the next status."""
    upto_status = [r for r in runs if int(r.run_id[-2:]) <= 7]  # inspect .. apply .. status (defrag applied)
    defrag = by_name(runs, "-06").doc["change_id"]
    assert _cells(upto_status, "lab-01")["applied changes"].lines == [f"{defrag} (defrag-tier0)"]
    rb = by_name(runs, "-13")
    rollback = dataclasses.replace(
        rb, run_id="rb-defrag", started_at=upto_status[-1].started_at + 60, ended_at=upto_status[-1].started_at + 70,
        hosts=[dataclasses.replace(rb.hosts[0], doc={**rb.hosts[0].doc, "change_id": defrag},
                                   change_ids=[defrag])])
    cell = _cells(upto_status + [rollback], "lab-01")["applied changes"]
    assert cell.lines == ["none"] and (cell.run_id, cell.command) == ("rb-defrag", "rollback")
    other = _cells(upto_status + [rollback], "lab-02")["applied changes"]
    assert other.run_id.endswith("-07"), "other hosts keep theirs"


def test_a_deploy_after_the_last_status_shows_its_kernel_and_its_rollback_removes_it(runs):
    upto_deploy = [r for r in runs if int(r.run_id[-2:]) <= 9]  # no status after the deploy (-09)
    key = by_name(runs, "-09").hosts[0].doc["build_key"]
    cell = _cells(upto_deploy, "lab-01")["active kernels"]
    assert cell.lines == [f"verify_attention {key[:12]}"] and cell.run_id.endswith("-09")
    assert _cells(upto_deploy, "lab-02")["active kernels"].lines == ["none"], "lab-02 got no deploy"
    check_only = [r for r in runs if int(r.run_id[-2:]) <= 8]  # the --check deploy changes nothing
    assert _cells(check_only, "lab-01")["active kernels"].lines == ["none"]
    after_rollback = [r for r in runs if int(r.run_id[-2:]) <= 13]  # its rollback, no status since
    cell = _cells(after_rollback, "lab-01")["active kernels"]
    assert cell.lines == ["none"] and cell.run_id.endswith("-13")


def test_a_rollback_of_a_change_the_history_never_saw_marks_the_cells_unknown(runs):
    status = by_name(runs, "-07")
    rb = by_name(runs, "-13")
    unseen = dataclasses.replace(rb.hosts[0], doc={**rb.hosts[0].doc, "change_id": "20200101T000000Z-x-1"})
    rollback = dataclasses.replace(rb, run_id="rb-unknown", started_at=status.started_at + 60, hosts=[unseen])
    cells = _cells([status, rollback], "lab-01")
    for title in ("applied changes", "active kernels"):
        assert cells[title].run_id == "rb-unknown"
        line = cells[title].lines[0]
        assert line.startswith("unknown: changed by rollback") and "fleetctl status" in line


def test_an_unreachable_host_reads_unreachable_not_no_install(runs):
    inspect = by_name(runs, "-01")
    down = dataclasses.replace(inspect, run_id="down", hosts=[
        HostRecord("lab-09", "10.213.250.9", "unreachable", "connect timed out", 2.0,
                   {"host": "lab-09", "status": "unreachable", "installs": [], "facts": {}})])
    cells = _cells([down], "lab-09")
    assert all(c.lines == [report_html.UNREACHABLE_CELL] for c in cells.values())
    later = dataclasses.replace(down, run_id="later", started_at=inspect.started_at + 60,
                                hosts=[dataclasses.replace(down.hosts[0], host="lab-01")])
    kept = _cells([inspect, later], "lab-01")["SGLang installs"]
    assert kept.run_id == inspect.run_id and kept.lines[0].startswith("0.5.2 wheel"), "unreachable read no installs"
    html = report_html.render([down], NOW)
    assert "no SGLang install found" not in html and report_html.UNREACHABLE_CELL in html


def test_the_timeline_has_a_legend_and_a_letter_per_command(runs, page):
    from fleetctl.report import svg
    marks = [t for t, a in page.tags if t == "text" and "mark" in (a.get("class") or "").split()]
    assert len(marks) == len(page.all("circle", "point"))
    assert [a["data-command"] for a in page.all("span", "legend-mark")] == list(svg.MARKS)
    assert [a["data-status"] for a in page.all("span", "legend-status")] == \
        ["ok", "changed", "skipped", "failed", "unreachable", "not attempted"]
    text = "".join(page.text)
    assert all(f"{letter} {command}" in text for command, letter in svg.MARKS.items())
