"""The HTML fleet report in a real browser: Debian's chromium driven by Selenium through Debian's
chromedriver (Service('/usr/bin/chromedriver') given, so Selenium Manager never fetches one),
headless, in a network namespace of its own that has only loopback (`unshare --net`: made for the
run, gone with it). The report is the recorded lab sequence's (tests/golden/history/) read from a
real history file by `fleetctl report`, with one host's name, error and diff carrying
`<img src=http://192.0.2.1/x>` and a terminal escape.

The test reads the rendered DOM (every host, run, change id and status; each chart's points) and
the browser's logs (`goog:loggingPrefs`: the console, and the performance log's network events):
no console error, no CSP violation, no request but the page itself. It then adds an image of a
loopback URL to the page and sees the page's own policy refuse it: a CSP violation in the console
and no request (the same image on a page without the policy is requested: the check can see one).

Run as a script (inside the namespace) it is the browser side: `python3 THIS PAGE [SCREENSHOT]`
prints what it read as JSON. `python3 THIS --screenshot docs/report.png` renders the recorded
report and takes the README's picture of it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
HOSTILE = "<img src=http://192.0.2.1/x>\x1b[31mRED\x1b[0m"
PROBE = "http://127.0.0.1:61999/probe.png"  # loopback in the namespace: nothing listens there
ADD_PROBE = ("const i = document.createElement('img'); i.src = arguments[0]; i.id = 'probe';"
             "document.body.appendChild(i);")


def _requests(perf: list[dict], page: str) -> dict[str, str]:
    """What became of each URL the document `page` asked for, itself included (the performance
    log's Network events; the browser's own start page is another document):
    "loaded" (a response came), "blocked: csp" (the browser refused it before any connection:
    Network.loadingFailed's blockedReason) or the network error (net::ERR_...)."""
    urls, outcome = {}, {}
    for e in perf:
        m = json.loads(e["message"])["message"]
        p = m.get("params") or {}
        if m.get("method") == "Network.requestWillBeSent" and p.get("documentURL") == page:
            urls[p["requestId"]] = p["request"]["url"]
        elif m.get("method") == "Network.responseReceived":
            outcome[p["requestId"]] = "loaded"
        elif m.get("method") == "Network.loadingFailed":
            outcome[p["requestId"]] = f"blocked: {p['blockedReason']}" if p.get("blockedReason") else p.get("errorText")
    return {url: outcome.get(rid, "pending") for rid, url in urls.items()}


def _console(entries: list[dict]) -> list[dict]:
    """The console entries but those of the browser's own pages (chrome://: its start page's
    "Slow network is detected" in a namespace without a network)."""
    return [e for e in entries if not e["message"].startswith("chrome://")]


def browse(page: Path, screenshot: Path | None = None) -> dict:
    """Open `page` (file://) in headless chromium; what it shows and logged: {hosts (the
    overview's rows), results ([host, status] per run's host row), change_ids, runs (section
    ids), charts ([[class of each point] per chart]), marks (the timeline points' letters),
    legend (the text of each legend line), text (the page's visible text), images,
    scripts (element counts), console and requests (_requests) at load, then console_probe
    and requests_probe after PROBE was added}."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    profile = tempfile.mkdtemp(prefix="fleetctl-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--user-data-dir={profile}", "--window-size=1400,1600", "--no-first-run",
                "--disable-background-networking", "--disable-component-update"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        for log in ("browser", "performance"):  # the start page's entries, before the report's
            driver.get_log(log)
        url = page.resolve().as_uri()
        driver.get(url)
        css = lambda sel: driver.find_elements(By.CSS_SELECTOR, sel)  # noqa: E731
        out = {
            "hosts": [e.get_attribute("data-host") for e in css("tr.host-row")],
            "results": [[e.get_attribute("data-host"), e.get_attribute("data-status")] for e in css("tr.host-result")],
            "statuses": [e.text for e in css("tr.host-result td.status")],
            "change_ids": sorted({e.text for e in css("td.change-id") if e.text}),
            "runs": [e.get_attribute("data-run") for e in css("section.run")],
            "charts": [[p.get_attribute("class") for p in svg.find_elements(By.CSS_SELECTOR, ".point")]
                       for svg in css("svg.chart")],
            "marks": [e.text for e in css("svg.chart text.mark")],
            "legend": [e.text for e in css("p.legend")],
            "text": driver.find_element(By.TAG_NAME, "body").text,
            "images": len(css("img")), "scripts": len(css("script")),
            "console": _console(driver.get_log("browser")), "requests": _requests(driver.get_log("performance"), url),
        }
        if screenshot is not None:
            height = driver.execute_script("return document.documentElement.scrollHeight")
            driver.set_window_size(1400, min(height, 2400))
            driver.save_screenshot(str(screenshot))
        driver.execute_script(ADD_PROBE, PROBE)
        time.sleep(1.0)
        out["console_probe"] = _console(driver.get_log("browser"))
        out["requests_probe"] = _requests(driver.get_log("performance"), url)
        return out
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def in_namespace(page: Path, screenshot: Path | None = None, timeout: float = 120) -> dict:
    """browse(page) in a new network namespace with only loopback up (run as root)."""
    script = 'ip link set lo up && exec "$0" "$@"'
    argv = ["unshare", "--net", "sh", "-c", script, sys.executable, __file__, str(page)]
    r = subprocess.run(argv + ([str(screenshot)] if screenshot else []), capture_output=True, text=True,
                       timeout=timeout, env=dict(os.environ, PYTHONPATH=str(ROOT / "agent")))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def _recorded_report(tmp: Path, hostile: bool) -> Path:
    """`fleetctl report` of a history file holding the recorded runs (with HOSTILE planted in
    lab-02's name and error in the last status, and in lab-01's diff in the apply, and figures no
    chart can draw in lab-01's load gate: a negative baseline, a NaN limit, when asked)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import dataclasses

    from report_runs import recorded_runs, write_store

    runs = recorded_runs()
    if hostile:
        status = next(r for r in runs if r.run_id.endswith("-11"))
        h = status.hosts[1]
        status.hosts[1] = dataclasses.replace(h, host=HOSTILE, error=HOSTILE, doc={**h.doc, "host": HOSTILE,
                                                                                    "error": HOSTILE})
        apply = next(r for r in runs if r.run_id.endswith("-06"))
        apply.hosts[0].doc["plan"]["files"][0]["diff"] = HOSTILE + "\n"
        gate = apply.hosts[0].doc["load_gate"]["servers"][0]
        gate["baseline"]["p99_ttft_ms"], gate["limits"]["output_throughput"] = -5.0, float("nan")
    history = write_store(tmp / "history.sqlite", runs)
    page = tmp / "fleet.html"
    subprocess.run([sys.executable, "-m", "fleetctl.cli", "report", "-o", str(page), "--history", str(history)],
                   check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT / "agent")), capture_output=True)
    return page


if __name__ == "__main__":
    if sys.argv[1] == "--screenshot":
        with tempfile.TemporaryDirectory() as d:
            got = in_namespace(_recorded_report(Path(d), hostile=False), Path(sys.argv[2]).resolve())
        print(f"{sys.argv[2]}: {len(got['runs'])} runs, {len(got['hosts'])} hosts")
    else:
        print(json.dumps(browse(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None)))
    sys.exit(0)

import pytest  # noqa: E402 - the script side above needs only selenium

from conftest import missing  # noqa: E402


@pytest.fixture(scope="module")
def browser_ready():
    if os.geteuid() != 0:
        missing("the browser test needs root (a network namespace of its own)", "FLEETCTL_REQUIRE_LAB")
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            missing(f"no {path}: apt-get install chromium chromium-driver (scripts/setup.sh)", "FLEETCTL_REQUIRE_LAB")
    pytest.importorskip("selenium")


@pytest.fixture(scope="module")
def seen(browser_ready, tmp_path_factory):
    return in_namespace(_recorded_report(tmp_path_factory.mktemp("report"), hostile=True))


def _csp_errors(entries: list[dict]) -> list[str]:
    return [e["message"] for e in entries if "Content Security Policy" in e["message"]]


def test_the_browser_shows_every_host_run_change_and_status(seen):
    sys.path.insert(0, str(ROOT / "tests"))
    from report_runs import recorded_runs

    runs = recorded_runs()
    shown = HOSTILE.replace("\x1b", "\\x1b")
    assert seen["hosts"] == ["lab-01", "lab-02", "lab-03", shown]
    assert seen["runs"] == [r.run_id for r in reversed(runs)]
    want = [[shown if (r.run_id.endswith("-11") and n == 1) else h.host, h.status]
            for r in reversed(runs) for n, h in enumerate(r.hosts)]
    assert seen["results"] == want
    assert seen["statuses"] == [s for _, s in want]
    assert seen["change_ids"] == sorted({r.doc["change_id"] for r in runs if r.doc.get("change_id")})


def test_the_charts_have_their_points(seen):
    timeline, *gates = seen["charts"]
    assert timeline == ["point changed", "point failed", "point skipped", "point changed",  # apply, deploy
                        "point changed", "point ok", "point ok", "point ok"]  # rollback, recover
    assert gates == [["point baseline", "point after ok"] * 3, ["point baseline", "point after breach"] * 3]


def test_the_timeline_shows_its_legend_and_a_letter_per_point(seen):
    """Issue 50: the points were told apart by hovering only, which a printed or mailed page cannot."""
    assert seen["marks"] == ["A", "A", "A", "D", "R", "C", "C", "C"]
    (legend,) = seen["legend"]
    for words in ("A apply", "D deploy kernel", "R rollback", "C recover", "changed", "failed", "unreachable"):
        assert words in legend


def test_host_text_shows_literally_and_loads_nothing(seen):
    shown = HOSTILE.replace("\x1b", "\\x1b")
    assert seen["text"].count(shown) >= 3  # overview row, the run's row, its error (the diff is folded)
    assert seen["images"] == 0 and seen["scripts"] == 0
    assert list(seen["requests"].values()) == ["loaded"]  # the page itself, and nothing else
    assert seen["console"] == [], "no console error, no CSP violation"


def test_the_pages_policy_refuses_a_load(seen):
    assert seen["requests_probe"] == {PROBE: "blocked: csp"}, "refused before any connection"
    assert [m for m in _csp_errors(seen["console_probe"]) if PROBE in m], seen["console_probe"]


def test_the_check_sees_a_request_where_no_policy_refuses_it(browser_ready, tmp_path):
    page = tmp_path / "open.html"
    page.write_text("<!DOCTYPE html><html><head><title>no policy</title></head><body><p>x</p></body></html>")
    got = in_namespace(page)
    assert got["requests_probe"] == {PROBE: "net::ERR_CONNECTION_REFUSED"}  # tried: nothing listens on port 9
    assert not _csp_errors(got["console_probe"])
