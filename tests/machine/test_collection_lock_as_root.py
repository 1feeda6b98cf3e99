"""The collection's lease on fleetctl's host lock with real processes, as root (security review turn 3,
N12). The lock and patch modules run as Ansible runs them on a host (`python -m` the module, its
arguments in a file, from a fresh `fleetctl collection build`), against a state dir of the test's;
fleetctl's own lock is taken the way `fleetctl recover` takes it (Connection.hold_lock, the local
kind: the same flock on STATE_DIR/lock). When a module has answered, nothing is left of the run
that took a lease (no controller renews or releases it), as after a killed ansible-playbook.

A reboot is emulated by the lease record itself: STATE_DIR/lock.lease rewritten as an earlier boot
would have left it (another boot id), since this machine cannot reboot under a test; the boot id
and the clock the modules read are the host's own, and no module option changes them."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import MappingProxyType

import pytest

from fleetctl.collection import build, ops
from fleetctl.connection import LockBusy, Session, Settings
from fleetctl.inventory import Host

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@pytest.fixture(scope="module")
def collection(tmp_path_factory) -> Path:
    """The directory holding ansible_collections/ (what a host's module imports from)."""
    return build.build(tmp_path_factory.mktemp("collection")).parents[2]


@pytest.fixture(autouse=True)
def no_holder_left(tmp_path):
    """After each test, a lease holder it left (a failed assertion before its release) is ended."""
    yield
    for record in tmp_path.rglob("lock.lease"):
        try:
            lease = json.loads(record.read_text())
            start = Path(f"/proc/{lease['pid']}/stat").read_text().rsplit(")", 1)[1].split()[19]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if start == lease.get("start"):
            os.killpg(lease["pid"], signal.SIGTERM)


def module(collection: Path, name: str, **args) -> dict:
    """The collection's module `name` run with `args` as on a host: its JSON answer."""
    path = collection / f"args-{uuid.uuid4().hex}.json"
    path.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    r = subprocess.run([sys.executable, "-m", f"ansible_collections.fleetctl.sglang.plugins.modules.{name}", str(path)],
                       capture_output=True, text=True, timeout=60, cwd=collection,
                       env=dict(os.environ, PYTHONPATH=str(collection)))
    try:
        return json.loads(r.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"{name}: no JSON (exit {r.returncode}): {r.stdout[-1500:]} {r.stderr[-1500:]}") from None


def fleetctl_lock(sd: Path):
    """fleetctl's own lock on this machine's `sd`, as recover takes it: the HostLock, or LockBusy's message."""
    conn = Session(Settings()).connect(Host("here", MappingProxyType({"ansible_connection": "local"}), ("all",)))
    try:
        return conn.hold_lock(str(sd), timeout=10, hold_s=30)
    except LockBusy as e:
        return str(e)


def free_within(sd: Path, seconds: float) -> float:
    """Seconds until fleetctl's lock on `sd` could be taken (then released), failing past `seconds`."""
    t0 = time.monotonic()
    while True:
        got = fleetctl_lock(sd)
        if not isinstance(got, str):
            got.release()
            return time.monotonic() - t0
        assert time.monotonic() - t0 < seconds, f"fleetctl's lock still busy after {seconds} s: {got}"
        time.sleep(0.2)


def rewrite(sd: Path, **fields) -> None:
    """Change `fields` of the lease record in place, under its flock (as the lock module writes it)."""
    with open(sd / "lock.lease", "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        lease = dict(json.loads(f.read()), **fields)
        f.seek(0)
        f.truncate()
        f.write(json.dumps(lease))


def test_a_lease_from_an_earlier_boot_is_void_and_frees_fleetctls_lock(collection, tmp_path):
    """A lease taken by a run that is gone blocks fleetctl (LockBusy naming its holder); once its record
    is an earlier boot's, the lease is void: its holder ends within a second, fleetctl's lock is free
    (so `fleetctl recover` runs), and a new lease can be taken."""
    sd = tmp_path / "state"
    got = module(collection, "lock", lease_s=300, holder="play-killed", state_dir=str(sd))
    assert got["changed"] and got["lease"]["boot_id"] == BOOT_ID.read_text().strip(), got
    busy = fleetctl_lock(sd)
    assert isinstance(busy, str) and "play-killed since" in busy, busy
    rewrite(sd, boot_id=str(uuid.uuid4()))
    assert free_within(sd, 5) < 5
    again = module(collection, "lock", lease_s=300, holder="next-play", wait_s=0, state_dir=str(sd))
    assert again["changed"] and again["lease"]["holder"] == "next-play", again
    assert module(collection, "lock", state="released", state_dir=str(sd))["changed"]
    assert free_within(sd, 1) < 1


def test_a_lease_ends_after_its_time_on_the_boot_clock(collection, tmp_path):
    """A lease holds fleetctl's lock for its lease_s and no longer; its time is CLOCK_BOOTTIME's (a
    suspend counts), so a record whose end on that clock has passed (what a suspend of its length
    does) is void at once, with no renewal."""
    sd = tmp_path / "state"
    t0 = time.monotonic()
    assert module(collection, "lock", lease_s=2, holder="short", state_dir=str(sd))["changed"]
    assert isinstance(fleetctl_lock(sd), str)
    free_within(sd, 6)
    assert 1.5 < time.monotonic() - t0 < 6
    got = module(collection, "lock", lease_s=300, holder="suspended", state_dir=str(sd))
    assert got["changed"] and isinstance(fleetctl_lock(sd), str)
    rewrite(sd, expires=time.clock_gettime(time.CLOCK_BOOTTIME) - 1)
    assert free_within(sd, 5) < 5


def test_a_lease_is_renewed_by_its_token_and_another_run_waits(collection, tmp_path):
    """state=acquired with the lease's token renews it in place (same holder process, a later end);
    without it, another run waits wait_s and fails naming the holder; a release with another token
    frees nothing, one with the lease's token frees the lock at once."""
    sd = tmp_path / "state"
    first = module(collection, "lock", lease_s=5, holder="play-1", state_dir=str(sd))["lease"]
    renewed = module(collection, "lock", lease_s=300, token=first["token"], state_dir=str(sd))
    assert renewed["changed"] is False and renewed["lease"]["pid"] == first["pid"], renewed
    assert renewed["lease"]["expires"] > first["expires"] + 290
    assert renewed["ansible_facts"]["fleetctl_lease"]["token"] == first["token"]
    t0 = time.monotonic()
    other = module(collection, "lock", lease_s=60, holder="play-2", wait_s=1, state_dir=str(sd))
    assert other.get("failed") and "another fleetctl run is changing this host (play-1 since" in other["msg"], other
    assert time.monotonic() - t0 >= 1
    assert module(collection, "lock", state="released", token="0" * 32, state_dir=str(sd))["changed"] is False
    assert isinstance(fleetctl_lock(sd), str)
    assert module(collection, "lock", state="released", token=first["token"], state_dir=str(sd))["changed"]
    assert free_within(sd, 1) < 1


def test_a_pending_change_is_written_only_under_a_live_lease(collection, site):
    """The patch module on a host refuses a pending change (commit false) with no live lease, and with a
    lease whose record is an earlier boot's, changing nothing; under a live lease it writes it, and
    fleetctl's lock (recover's) stays busy until the lease is released."""
    _, state, params, originals = site
    plan = dict({k: params[k] for k in ("change_id", "playbook", "operator", "root", "files")},
                install=None, shared_tree=False)

    def untouched() -> bool:
        ledger = state / "ledger.jsonl"
        return all(Path(p).read_bytes() == b for p, b in originals.items()) and \
            (not ledger.exists() or "c1" not in ledger.read_text())

    refused = module(collection, "patch", plan=plan, state_dir=str(state))
    assert refused.get("failed") and "without a lease on fleetctl's host lock" in refused["msg"], refused
    assert untouched()
    module(collection, "lock", lease_s=300, holder="play", state_dir=str(state))
    rewrite(state, boot_id=str(uuid.uuid4()))
    refused = module(collection, "patch", plan=plan, state_dir=str(state))
    assert refused.get("failed") and "without a lease" in refused["msg"], refused
    assert untouched()
    free_within(state, 5)
    module(collection, "lock", lease_s=300, holder="play", state_dir=str(state))
    wrote = module(collection, "patch", plan=plan, state_dir=str(state))
    assert wrote["changed"] and wrote["pending"] == ["c1"], wrote
    assert isinstance(fleetctl_lock(state), str)
    assert module(collection, "lock", state="released", state_dir=str(state))["changed"]
    back = module(collection, "patch", state="rolled_back", change_id="c1", state_dir=str(state))
    assert back["changed"] and back["pending"] == [], back
    assert all(Path(p).read_bytes() == b for p, b in originals.items())


def test_the_plugins_lease_is_taken_renewed_and_ended_with_the_lock_module(collection, tmp_path):
    """ops.hold_lease and ops.settle_lease (what the patch and smoke plugins do) with the real lock
    module: a play with no lease gets one (auto), renewing keeps its token and the play's lease_s
    whatever the extra time, and it ends once nothing is pending; the play's own lease is kept."""
    sd = str(tmp_path / "state")

    def run(name: str, args: dict) -> dict:
        return module(collection, name.rsplit(".", 1)[1], **args)

    fact = ops.hold_lease(run, {}, sd)
    assert fact["auto"] is True and fact["holder"] == ops.AUTO_HOLDER and fact["state_dir"] == sd
    longer = ops.hold_lease(run, fact, sd, extra_s=600)
    assert longer["token"] == fact["token"] and longer["auto"] is True and longer["lease_s"] == ops.LEASE_S
    assert longer["expires"] > fact["expires"] + 590
    assert ops.settle_lease(run, longer, failed=False, pending=["c1"]) == longer
    assert isinstance(fleetctl_lock(Path(sd)), str)
    assert ops.settle_lease(run, longer, failed=False, pending=[]) == {}
    assert free_within(Path(sd), 1) < 1
    plays = module(collection, "lock", lease_s=120, holder="play", state_dir=sd)["ansible_facts"]["fleetctl_lease"]
    kept = ops.hold_lease(run, plays, sd)
    assert kept["auto"] is False and kept["token"] == plays["token"] and kept["lease_s"] == 120
    assert ops.settle_lease(run, kept, failed=True, pending=None) == kept
    assert isinstance(fleetctl_lock(Path(sd)), str)
    assert module(collection, "lock", state="released", state_dir=sd)["changed"]
