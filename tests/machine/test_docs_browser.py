"""The built documentation site in a real browser: every page of it, served over HTTP on loopback
(Python's http.server) and opened in Debian's headless chromium (Selenium through
/usr/bin/chromedriver), in a network namespace of its own that has only loopback (`unshare --net`),
as test_report_browser does. Each page must load with its title, log no console error and ask for
nothing from another origin; every internal link of every page (the theme's navigation
included) must name a page of the site and, with a fragment, an element of that page.

Run as a script (inside the namespace) it is the browser side: `python3 THIS SITE_DIR` prints what
it saw as JSON."""

from __future__ import annotations

import functools
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urldefrag, urlparse

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
LINKS = ("return Array.from(document.querySelectorAll('a[href]')).map(a => a.href);")
IDS = "return Array.from(document.querySelectorAll('[id]')).map(e => e.id);"


def browse(site: Path) -> dict:
    """Serve `site` on 127.0.0.1 and open each of its pages (404.html aside) in headless chromium:
    {pages: {path: {title, console (entries), foreign (requests to another origin), links
    (same-origin hrefs), ids}}}."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    origin = f"http://127.0.0.1:{server.server_address[1]}"
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--disable-background-networking", "--disable-component-update"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    pages = {}
    try:
        driver.get_log("browser")
        for html in sorted(site.rglob("*.html")):
            rel = html.relative_to(site).as_posix()
            if rel == "404.html":
                continue
            driver.get(f"{origin}/{rel}")
            requests = [json.loads(e["message"])["message"] for e in driver.get_log("performance")]
            asked = [m["params"]["request"]["url"] for m in requests if m.get("method") == "Network.requestWillBeSent"]
            pages[rel] = {
                "title": driver.title,
                "console": [e for e in driver.get_log("browser") if not e["message"].startswith("chrome://")],
                "foreign": [u for u in asked if not u.startswith((origin, "data:", "blob:"))],
                "links": [u for u in driver.execute_script(LINKS) if u.startswith(origin)],
                "ids": driver.execute_script(IDS),
            }
    finally:
        driver.quit()
        server.shutdown()
    return {"origin": origin, "pages": pages}


def in_namespace(site: Path, timeout: float = 300) -> dict:
    """browse(site) in a new network namespace with only loopback up (run as root)."""
    argv = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', sys.executable, __file__, str(site)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


if __name__ == "__main__":
    print(json.dumps(browse(Path(sys.argv[1]))))
    sys.exit(0)

import pytest  # noqa: E402 - the script side above needs only selenium

from conftest import missing  # noqa: E402


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    if os.geteuid() != 0:
        missing("the browser test needs root (a network namespace of its own)", "FLEETCTL_REQUIRE_LAB")
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            missing(f"no {path}: apt-get install chromium chromium-driver (scripts/setup.sh)", "FLEETCTL_REQUIRE_LAB")
    pytest.importorskip("selenium")
    site = tmp_path_factory.mktemp("docs") / "site"
    built = subprocess.run(["bash", "scripts/docs.sh", "build", "-d", str(site)], cwd=ROOT, capture_output=True,
                           text=True, env=dict(os.environ, PIP_NO_INDEX="1"), timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    return site, in_namespace(site)


def test_every_page_loads_with_no_console_error_and_nothing_from_elsewhere(seen):
    site, got = seen
    pages = got["pages"]
    assert len(pages) >= 30 and "index.html" in pages and "reference/cli.html" in pages
    for rel, page in pages.items():
        assert page["title"].endswith("fleetctl"), (rel, page["title"])
        assert not [e for e in page["console"] if e["level"] in ("SEVERE", "WARNING")], (rel, page["console"])
        assert not page["foreign"], (rel, page["foreign"])


def test_every_internal_link_names_a_page_and_an_element_of_it(seen):
    site, got = seen
    ids = {rel: set(page["ids"]) for rel, page in got["pages"].items()}
    broken = []
    for rel, page in got["pages"].items():
        for href in page["links"]:
            url, fragment = urldefrag(href)
            path = urlparse(url).path.lstrip("/") or "index.html"
            target = site / path
            if target.is_dir():
                path, target = f"{path.rstrip('/')}/index.html".lstrip("/"), target / "index.html"
            if not target.is_file():
                broken.append((rel, href, "no such file"))
            elif fragment and path in ids and fragment not in ids[path]:
                broken.append((rel, href, "no such element"))
    assert not broken, broken[:20]
