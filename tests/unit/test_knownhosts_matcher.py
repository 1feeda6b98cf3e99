"""The known_hosts matcher without ssh-keygen (connection/knownhosts.py _applies, what found_lines
uses where OpenSSH's ssh-keygen is not on PATH) finds exactly the lines `ssh-keygen -F NAME`
finds, on a file of the lines OpenSSH reads its own way: markers (a tab after one, a marker in
capitals), hashed names (a hashed field with a plain name after it, a malformed salt), negation,
wildcards, `[host]:port`, lines without a key, case (ASCII only: the Kelvin sign is no k)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from fleetctl.connection import knownhosts
from fleetctl.connection._paramiko import paramiko

NAMES = ["lab-01", "LAB-01", "Lab-01", "lab-02", "[lab-01]:2222", "[LAB-01]:2222", "10.213.250.15", "[10.213.250.15]:2222",
         "gpu-9.example.invalid", "gpu-1.example.invalid", "x", "lab-01.", "lab-\u212a1", "lab-k1"]


def corpus(key: str) -> list[str]:
    h = paramiko.HostKeys.hash_host
    return [
        f"lab-01 {key}", f"LAB-01 {key}", f"lab-0? {key}", f"lab-*,!lab-02 {key}", f"!lab-01,lab-* {key}",
        f"{h('lab-01')} {key}", f"{h('LAB-01')} {key}", f"{h('[lab-01]:2222')} {key}", f"[lab-01]:2222 {key}",
        f"[lab-01]:* {key}", f"[lab-0?]:2222 {key}", f"@revoked lab-01 {key}", f"@cert-authority *.example.invalid {key}",
        f"@cert-authority !gpu-9.example.invalid,*.example.invalid {key}", f"  lab-01 {key}", f"lab-01,other {key}",
        f"#lab-01 {key}", "lab-01", "@revoked lab-01", f"lab-01\t{key}", f"* {key}", f"10.213.250.* {key}",
        f"[10.213.250.15]:2222 {key}", "lab-01 ssh-ed25519", "lab-01 ssh-ed25519 !!!", f"{h('lab-01')},lab-02 {key}",
        f"lab-02,{h('lab-01')} {key}", f"!{h('lab-01')},lab-* {key}", f"lab-01, {key}", f",lab-01 {key}",
        f"lab-01 {key} comment lab-02", f"@REVOKED lab-01 {key}", f"@revoked\tlab-01 {key}", f"lab-01.* {key}",
        f"lab-01. {key}", f"\u212aab {key}", f"lab-\u212a1 {key}", f"lab-k1 {key}", f"|1|bad|bad {key}",
        f"|1|{'A' * 28}|x {key}", f"|2|{h('lab-01')[3:]} {key}", f"@cert-authority lab-01 {key}", f"lab-01 {key}\r",
    ]


@pytest.fixture(scope="module")
def known_hosts(tmp_path_factory):
    if shutil.which("ssh-keygen") is None:
        pytest.fail("ssh-keygen (OpenSSH's client) is not installed: run scripts/setup.sh")
    d = tmp_path_factory.mktemp("kh")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "k")], check=True)
    key = " ".join((d / "k.pub").read_text().split()[:2])
    f = d / "known_hosts"
    f.write_text("\n".join(corpus(key)) + "\n")
    return f


@pytest.mark.parametrize("name", NAMES)
def test_the_matcher_without_ssh_keygen_finds_the_lines_ssh_keygen_finds(known_hosts, name):
    by_keygen = [where for where, _ in knownhosts._found_by_ssh_keygen(name, known_hosts)]
    lines = known_hosts.read_text().splitlines()
    ours = [f"{known_hosts}:{n}" for n, line in enumerate(lines, start=1) if knownhosts._applies(line, name)]
    assert ours == by_keygen, [lines[int(w.rsplit(':', 1)[1]) - 1][:60] for w in set(ours) ^ set(by_keygen)]
    assert by_keygen or name == "x"  # the corpus names every name but one


def test_a_hashed_field_of_another_shape_names_no_host_and_never_raises():
    assert not knownhosts._applies("|1|bad|bad ssh-ed25519 AAAA", "lab-01")  # paramiko asserts the salt's length
    assert not knownhosts._applies("|1|" + "A" * 28 + "|x ssh-ed25519 AAAA", "lab-01")
    assert not knownhosts.host_patterns_match("lab-k1", "lab-\u212a1")  # re's IGNORECASE folds it; OpenSSH's tolower does not
