"""Golden outputs of the commands on a 2-host lab (0.5.2 and 0.5.23, stand-in servers): hosts,
inspect, apply --check --diff, status, validate, validate --load smoke (SGLang's own clients:
bench_serving on 0.5.2, whatever 0.5.23 runs), inspect --allocator-replay, deploy kernel --check,
and the failure paths (a pattern that matches nothing, a failed probe, an unreachable host); then
the runs that change hosts: deploy kernel --route all (the CPU backend), route-verify-attention
applied under the route gate (both servers speculating on triton), status showing the routes, and
the two rollbacks; last the run history of all of them (`history list`, `history show` of the
routed apply) and the HTML report. Each as `--json` where the command has it, exit status and
stderr, byte-equal to tests/golden/lab/ after normalising (tests/golden.py).

The tests depend on their order in this module (pytest's, as written): the read-only runs first,
on the lab as it comes up; the changing runs after them, rolled back (and the servers' restart
command put back) before the next test; the history and the report last, from this module's own
history file, which holds exactly this module's runs."""

from __future__ import annotations

import json
from html.parser import HTMLParser

import pytest
import yaml

from conftest import running_lab
from golden import ROOT, check, normalise_page, record

GOLDEN_LAB_ID = 109
RUNS = [
    ("hosts", ["hosts", "all"]),
    ("inspect", ["inspect", "all"]),
    ("inspect-no-match", ["inspect", "nosuchhost"]),
    ("apply-check-diff", ["apply", "defrag-tier0", "all", "--check", "--diff"]),
    ("status", ["status", "all"]),
    ("validate", ["validate", "all", "--repeat", "1"]),
    ("validate-no-install", ["validate", "all", "--install", "host:/opt/nowhere/sglang"]),
    ("deploy-kernel-check", ["deploy", "kernel", "verify_attention", "all", "--check"]),
    ("validate-load-smoke", ["validate", "all", "--load", "smoke"]),
    ("inspect-allocator-replay", ["inspect", "all", "--allocator-replay"]),
]
RESTART = "/opt/fleetctl-standin/restart.sh"
SPECULATIVE = "--attention-backend triton --speculative-algorithm STANDALONE --speculative-num-draft-tokens 4"
# the runs that change hosts, in order (test_golden_changes)
CHANGES = [
    ("deploy-kernel-route-all", ["deploy", "kernel", "verify_attention", "all", "--route", "all", "--yes",
                                 "--max-jobs", "2", "--repeat", "1"]),
    # (here both servers are restarted speculating on triton, and so is their restart handler)
    ("apply-route-verify-attention", ["apply", "route-verify-attention", "all", "--yes", "--repeat", "1"]),
    ("status-routed", ["status", "all"]),
    ("rollback-route", ["rollback", "--last", "all", "--yes"]),
    ("rollback-kernel", ["rollback", "--last", "all", "--yes"]),
]


@pytest.fixture(scope="module")
def golden_lab(lab_machine, tmp_path_factory):
    home = tmp_path_factory.mktemp("home-golden")
    with running_lab(home, GOLDEN_LAB_ID, ["0.5.2", "0.5.23"], hosts=2, with_server=True) as up:
        up.env["FLEETCTL_HISTORY"] = str(home / "history.sqlite")  # this module's runs only
        yield up


def _paths(lab) -> dict[str, str]:
    return {str(ROOT): "<repo>", str(lab.ssh_config.parent): "<home>"}


def _run(lab, name: str, argv: list[str], json_out: bool = True, timeout: float = 300):
    r = lab.cli(*argv, *(["--json"] if json_out else []), timeout=timeout)
    check(f"lab/{name}", record(name, argv, r.returncode, r.stdout, r.stderr, _paths(lab)))
    return r


@pytest.mark.parametrize("name,argv", RUNS, ids=[n for n, _ in RUNS])
def test_golden(golden_lab, name, argv):
    _run(golden_lab, name, argv)


def test_golden_unreachable(golden_lab):
    """A host that is down: unreachable (exit 3) with the connect error, the other host inspected."""
    golden_lab.fault("lab-02", "down")
    try:
        argv = ["inspect", "all", "--connect-timeout", "2"]
        r = golden_lab.cli(*argv, "--json")
    finally:
        golden_lab.fault("lab-02", "up")
    check("lab/inspect-unreachable", record("inspect-unreachable", argv, r.returncode, r.stdout, r.stderr,
                                            _paths(golden_lab)))


def _restart_cmds(lab) -> dict[str, str]:
    hosts = yaml.safe_load(lab.inventory.read_text())["all"]["children"]["lab"]["hosts"]
    return {h: hosts[h]["fleetctl_restart_cmd"] for h in lab.hosts}


def _serve(lab, host: str, restart: str) -> None:
    """Make `restart` the host's restart handler and (re)start its stand-in with it."""
    lab.add_host_vars(host, {"fleetctl_restart_cmd": restart})
    r = lab.ssh(host, restart, timeout=120)
    assert r.returncode == 0, (host, restart, r.stdout[-2000:], r.stderr[-2000:])


def test_golden_changes(golden_lab):
    """A real deploy with the operator's table (every shape routed), the servers restarted
    speculating (STANDALONE) on triton, route-verify-attention applied under the route gate on
    both, status showing the routes, then each host's last change rolled back twice (the route,
    the kernel). Whatever happens, the hosts end as they began: the restart handler put back and
    the servers restarted with it, and a change left applied by a failed step rolled back."""
    lab = golden_lab
    restarts = _restart_cmds(lab)
    rollbacks = 2  # the changes this test may leave applied on a host: the kernel, the route
    try:
        for name, argv in CHANGES:
            if name == "apply-route-verify-attention":
                for host in lab.hosts:
                    _serve(lab, host, f"{RESTART} {SPECULATIVE}")
            _run(lab, name, argv, timeout=900)
            rollbacks -= name.startswith("rollback-")
    finally:
        for host, restart in restarts.items():
            _serve(lab, host, restart)
        # after a failed step, whatever it left applied (this module's lab holds no other change:
        # a host with nothing left to roll back fails the rollback and is left as it is)
        for _ in range(rollbacks):
            lab.cli("rollback", "--last", "all", "--yes", "--no-history", timeout=300)


class _Text(HTMLParser):
    """The text of a page (entities decoded), one line per element's text, blank ones left out;
    the style element's content left out."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.lines: list[str] = []
        self._style = False
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self._style = tag == "style"

    def handle_endtag(self, tag):
        self._style = False

    def handle_data(self, data):
        if not self._style and data.strip():
            self.lines.append(" ".join(data.split()))


def test_golden_history_and_report(golden_lab):
    """The run history of this module's runs (`history list --json`, `history show --json` of the
    routed apply) and the HTML report of it (`-o -`), recorded as the page's text: one line per
    element's text, the style sheet left out (its markup and the charts' coordinates, which place
    points by time, are not compared), times and figures normalised (golden.normalise_page)."""
    lab = golden_lab
    r = _run(lab, "history-list", ["history", "list"])
    runs = json.loads(r.stdout)["runs"]
    routed = next(run["run_id"] for run in runs if "route-verify-attention" in " ".join(run["argv"]))
    _run(lab, "history-show-route", ["history", "show", routed])
    argv = ["report", "-o", "-", "--runs", "0"]
    r = lab.cli(*argv)
    out = json.dumps({"page_text": [normalise_page(line) for line in _Text(r.stdout).lines]}) \
        if r.returncode == 0 else r.stdout
    check("lab/report", record("report", argv, r.returncode, out, r.stderr, _paths(lab)))
