"""known_hosts lines of key types paramiko cannot read (security review turn 3, M2): the FIDO
types sk-ssh-ed25519 / sk-ecdsa-sha2-nistp256 and ssh-dss (paramiko 4 dropped DSA) are pins that
cannot be checked, kept with their file:line and type, never dropped; the paramiko host-key policy
then refuses the host instead of calling it unknown, and `--accept-new` stores nothing over them.
Through real sshd: tests/fleet/test_fleet_hostkey_types.py."""

from __future__ import annotations

import base64

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from fleetctl.connection import HostKeyRefused, knownhosts
from fleetctl.connection._paramiko import paramiko
from fleetctl.connection.paramiko_dial import _Policy, fingerprint
from keytypes import DSS, SK_ECDSA, SK_ED25519, public_key

READS_DSS = paramiko.hostkeys.HostKeyEntry.from_line("h " + public_key(DSS)) is not None


def ed25519_line() -> str:
    return ed25519.Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def offered() -> paramiko.PKey:
    """A host key a server offers (ed25519, a type paramiko reads)."""
    return paramiko.Ed25519Key(data=base64.b64decode(ed25519_line().split()[1]))


@pytest.mark.parametrize("matcher", ["ssh-keygen", "fallback"])
def test_pins_of_types_paramiko_cannot_read_are_kept_with_their_place(tmp_path, monkeypatch, matcher):
    if matcher == "fallback":
        (tmp_path / "bin").mkdir()
        monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    f = tmp_path / "known_hosts"
    real = ed25519_line()
    hashed = paramiko.HostKeys.hash_host("gpu-2.example.invalid")
    f.write_text(f"gpu-1.example.invalid {public_key(SK_ED25519)}\n"
                 f"{hashed} {public_key(SK_ECDSA)}\n"
                 f"[gpu-3.example.invalid]:2222 {public_key(DSS)}\n"
                 f"gpu-4.example.invalid {real}\n"
                 f"gpu-4.example.invalid {public_key(SK_ED25519)}\n")
    one = knownhosts.lookup("gpu-1.example.invalid", [f])
    assert one.keys.lookup("gpu-1.example.invalid") is None
    assert one.unverifiable == [knownhosts.Unverifiable(SK_ED25519, f"{f}:1")]
    assert one.warnings == [f"{f}:1: key type {SK_ED25519}: paramiko cannot verify this key type, so the host is "
                            "refused unless another line's key matches (use ansible_connection: ssh)"]
    assert knownhosts.lookup("gpu-2.example.invalid", [f]).unverifiable == [knownhosts.Unverifiable(SK_ECDSA, f"{f}:2")]
    three = knownhosts.lookup("[gpu-3.example.invalid]:2222", [f])
    if READS_DSS:  # paramiko 3: a DSA key it reads is a plain key like any other
        assert list(three.keys.lookup("[gpu-3.example.invalid]:2222")) == [DSS] and three.unverifiable == []
    else:
        assert three.keys.lookup("[gpu-3.example.invalid]:2222") is None
        assert three.unverifiable == [knownhosts.Unverifiable(DSS, f"{f}:3")]
    four = knownhosts.lookup("gpu-4.example.invalid", [f])  # a readable key next to an unreadable one
    assert [k.get_base64() for k in four.keys.lookup("gpu-4.example.invalid").values()] == [real.split()[1]]
    assert four.unverifiable == [knownhosts.Unverifiable(SK_ED25519, f"{f}:5")]
    other = knownhosts.lookup("gpu-5.example.invalid", [f])
    assert other.unverifiable == [] and other.keys.lookup("gpu-5.example.invalid") is None


@pytest.mark.parametrize("accept_new", [False, True], ids=["strict", "accept-new"])
def test_a_host_pinned_only_to_keys_paramiko_cannot_read_is_refused_and_nothing_is_stored(tmp_path, accept_new):
    f = tmp_path / "known_hosts"
    f.write_text(f"gpu-1.example.invalid {public_key(SK_ED25519)}\n"
                 f"gpu-1.example.invalid {public_key(SK_ECDSA)}\n")
    before = f.read_bytes()
    known = knownhosts.lookup("gpu-1.example.invalid", [f])
    policy = _Policy(known, "gpu-1.example.invalid", f if accept_new else None, hashed=False)
    key = offered()
    client = paramiko.SSHClient()
    with pytest.raises(HostKeyRefused) as e:
        policy.missing_host_key(client, "gpu-1.example.invalid", key)
    assert str(e.value) == (
        f"host key of gpu-1.example.invalid not verified: known_hosts pins it to a {SK_ED25519} key at {f}:1 and a "
        f"{SK_ECDSA} key at {f}:2, and paramiko cannot verify this key type: use ansible_connection: ssh (the host "
        f"offered {fingerprint(key)}, not stored); nothing was run")
    assert f.read_bytes() == before and client.get_host_keys().lookup("gpu-1.example.invalid") is None
