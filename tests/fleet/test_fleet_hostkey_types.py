"""Host keys pinned in known_hosts under a type paramiko cannot read, through real sshd (security
review turn 3, M2): sk-ssh-ed25519@openssh.com, sk-ecdsa-sha2-nistp256@openssh.com, and ssh-dss on
a paramiko without DSA. Such a pin used to be dropped, so the host looked unknown and
`--accept-new` trusted whatever key it offered. Now the paramiko connection refuses the host with
the file:line, the type and the fix, `--accept-new` or not, and known_hosts is left as it was; a
host whose own readable key is pinned next to such a line is still verified by that key. Whether
anything ran on a host is read from its sshd's log (LogLevel VERBOSE: one "Accepted publickey"
line a login)."""

from __future__ import annotations

import re

from conftest import write_ssh_config
from fleetctl import lab as labmod
from fleetctl.connection._paramiko import paramiko
from fleetctl.vocab import HostStatus
from keytypes import DSS, SK_ECDSA, SK_ED25519, public_key

ACCEPTED = re.compile(r"Accepted publickey for (\S+) from ")
READS_DSS = paramiko.hostkeys.HostKeyEntry.from_line("h " + public_key(DSS)) is not None


def plain_line(lab, host: str) -> str:
    """`host`'s real known_hosts line (address ssh-ed25519 base64), from the lab's known_hosts."""
    return next(line for line in lab.known_hosts.read_text().splitlines() if line.split()[0] == lab.address(host))


def sshd_log(lab, host: str) -> bytes:
    return (labmod.state_dir_for(lab.lab_id, lab.state_dir) / "hosts" / host / "sshd.log").read_bytes()


def test_a_host_pinned_to_a_key_type_paramiko_cannot_read_is_refused_with_accept_new_too(lab, tmp_path):
    # lab-01..03: the real ed25519 line replaced by a pin paramiko cannot read; lab-04: joined with one
    pinned = {"lab-01": SK_ED25519, "lab-02": SK_ECDSA, **({} if READS_DSS else {"lab-03": DSS})}
    lines = [f"{lab.address(h)} {public_key(t)}" for h, t in pinned.items()]
    lines += [plain_line(lab, "lab-04"), f"{lab.address('lab-04')} {public_key(SK_ED25519)}"]
    known = tmp_path / "known_hosts"
    known.write_text("\n".join(lines) + "\n")
    before = known.read_bytes()
    cfg = write_ssh_config(tmp_path / "config", known)
    logs = {h: len(sshd_log(lab, h)) for h in pinned}
    targets = ":".join([*pinned, "lab-04"])
    for extra in ([], ["--accept-new"]):
        r, _, hosts = lab.cli_json("inspect", targets, "-c", "paramiko", "--ssh-config", str(cfg), *extra)
        assert r.returncode == 3, (extra, {h: (v["status"], v["error"]) for h, v in hosts.items()}, r.stderr[-2000:])
        for n, (host, keytype) in enumerate(pinned.items(), start=1):
            h = hosts[host]
            assert h["status"] == HostStatus.UNREACHABLE and h["facts"] is None, (extra, h)
            assert re.fullmatch(
                rf"host key of {re.escape(lab.address(host))} not verified: known_hosts pins it to a "
                rf"{re.escape(keytype)} key at {re.escape(str(known))}:{n}, and paramiko cannot verify this key "
                r"type: use ansible_connection: ssh \(the host offered ssh-ed25519 SHA256:[A-Za-z0-9+/]{43}, not "
                r"stored\); nothing was run", h["error"]), (extra, h["error"])
        assert hosts["lab-04"]["status"] == HostStatus.OK and hosts["lab-04"]["facts"]["hostname"] == "lab-04", extra
        assert known.read_bytes() == before, extra  # nothing stored, nothing rewritten
        assert "Traceback" not in r.stdout + r.stderr
    for host, since in logs.items():
        assert ACCEPTED.findall(sshd_log(lab, host)[since:].decode(errors="replace")) == [], host
