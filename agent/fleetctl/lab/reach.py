"""Hosts for reaching tests: bare sshd hosts added to a running lab (behind a bastion, with a
CA-signed host key, with only an RSA host key)."""

from __future__ import annotations

import time
from pathlib import Path

from .base import SSHD, LabError, bridge_name, host_dir, host_name, load, require_root, run, spawn, state_dir_for
from .knownhosts import default_known_hosts, forget_known_hosts

# The reach hosts: name -> (what it is). Each is a bare sshd (LogLevel VERBOSE, its log in
# <host dir>/sshd.log) in a network namespace of its own, sharing this machine's filesystem: they
# exist to be reached, not to run SGLang.
REACH_HOSTS = {
    "lab-hidden": "reachable only through lab-01 (the bastion): no route from the control side",
    "lab-ca": "its ed25519 host key is signed by the lab's host CA; known_hosts has only @cert-authority",
    "lab-rsa": "only an RSA host key",
}


def reach_address(lab_id: int, name: str) -> str:
    """lab-hidden: 10.214.<lab-id>.2 on a link to lab-01 only; the others on the lab bridge."""
    return {"lab-hidden": f"10.214.{lab_id}.2", "lab-ca": f"10.213.{lab_id}.251",
            "lab-rsa": f"10.213.{lab_id}.252"}[name]


def _reach_sshd(name: str, ns: str, address: str, hd: Path, sd: Path, host_keys: list[Path],
                certificate: Path | None = None) -> int:
    cfg = hd / "sshd_config"
    cfg.write_text(
        f"ListenAddress {address}:22\n" + "".join(f"HostKey {k}\n" for k in host_keys)
        + (f"HostCertificate {certificate}\n" if certificate else "")
        + f"PidFile {hd / 'sshd.pid'}\nAuthorizedKeysFile {sd / 'client_ed25519.pub'}\n"
        "PermitRootLogin prohibit-password\nPubkeyAuthentication yes\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPrintMotd no\nUseDNS no\n"
        "LogLevel VERBOSE\n")
    return spawn(["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", str(cfg)], hd / "sshd.log").pid


def lab_add_reach_hosts(lab_id: int = 0, state_dir: Path | None = None, known_hosts: Path | None = None) -> dict:
    """Add REACH_HOSTS to the running lab `lab_id` and return {name: {address, log, key}}
    (`key`: the host's public key file). lab-01 becomes their bastion: lab-hidden sits on a link
    from lab-01's network namespace. `known_hosts` (default ~/.ssh/known_hosts of the passwd
    home) gets plain lines for lab-hidden and lab-rsa and one `@cert-authority` line for
    lab-ca's address; `lab_down` removes the hosts and those lines. Raises LabError."""
    require_root()
    sd = state_dir_for(lab_id, state_dir)
    state = load(sd)
    bastion = next(h for h in state["hosts"] if h["name"] == host_name(0))
    known_hosts = Path(known_hosts or default_known_hosts())
    out, lines = {}, []
    ca = sd / "host_ca"
    if not ca.exists():
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"fleetctl-lab-{lab_id}-host-ca", "-f", str(ca)])
    for name in REACH_HOSTS:
        ns, addr, hd = f"flab{lab_id}-{name[4:7]}", reach_address(lab_id, name), host_dir(sd, name)
        hd.mkdir(parents=True, exist_ok=True)
        ktype = "rsa" if name == "lab-rsa" else "ed25519"
        key = hd / f"ssh_host_{ktype}_key"
        key.unlink(missing_ok=True)
        run(["ssh-keygen", "-q", "-t", ktype, "-N", "", "-C", name, "-f", str(key)])
        run(["ip", "netns", "add", ns])
        run(["ip", "link", "add", ns, "type", "veth", "peer", "name", ns + "p"])
        run(["ip", "link", "set", ns + "p", "netns", ns])
        if name == "lab-hidden":  # a link to the bastion's namespace only
            run(["ip", "link", "set", ns, "netns", bastion["netns"]])
            for cmd in (["addr", "add", f"10.214.{lab_id}.1/24", "dev", ns], ["link", "set", ns, "up"]):
                run(["ip", "-n", bastion["netns"], *cmd])
        else:
            run(["ip", "link", "set", ns, "master", bridge_name(lab_id), "up"])
        for cmd in (["link", "set", ns + "p", "name", "eth0"], ["addr", "add", f"{addr}/24", "dev", "eth0"],
                    ["link", "set", "eth0", "up"], ["link", "set", "lo", "up"]):
            run(["ip", "-n", ns, *cmd])
        cert = None
        pub = key.with_name(key.name + ".pub")
        if name == "lab-ca":
            run(["ssh-keygen", "-q", "-s", str(ca), "-I", name, "-h", "-n", addr, str(pub)])
            cert = key.with_name(key.name + "-cert.pub")
            lines.append(f"@cert-authority {addr} {' '.join((sd / 'host_ca.pub').read_text().split()[:2])}\n")
        else:
            lines.append(f"{addr} {' '.join(pub.read_text().split()[:2])}\n")
        (hd / "sshd.log").write_bytes(b"")
        _reach_sshd(name, ns, addr, hd, sd, [key], cert)
        out[name] = {"address": addr, "log": hd / "sshd.log", "key": pub}
    deadline = time.monotonic() + 15
    for name, h in out.items():  # lab-hidden cannot be dialled from here: its log says when it listens
        while b"Server listening" not in h["log"].read_bytes():
            if time.monotonic() > deadline:
                raise LabError(f"{name}: sshd did not start, see {h['log']}")
            time.sleep(0.05)
    forget_known_hosts(known_hosts, [h["address"] for h in out.values()])
    with open(known_hosts, "a") as f:
        f.writelines(lines)
    return out
