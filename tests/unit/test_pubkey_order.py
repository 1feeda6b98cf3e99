"""OpenSSH's key order (sshconnect2.c pubkey_prepare) and certificate reading, pure: the order
from made-up key blobs, the certificate fields from real ssh-keygen certificates; the key files
read as ssh reads them (keyfiles.py). The same against a real sshd and ssh-agent:
tests/machine/test_ssh_user_certificates.py."""

from __future__ import annotations

import base64
import struct
import subprocess
import time
from pathlib import Path

import pytest

from fleetctl.connection import keyfiles, pubkey_order
from fleetctl.connection.pubkey_order import Offer, order, signer
from fleetctl.connection.resolve import Resolver


def _s(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def key(name: str) -> bytes:
    """A made-up ed25519 public key blob."""
    return _s(b"ssh-ed25519") + _s(name.encode().ljust(32, b"."))


def cert(name: str) -> bytes:
    """A made-up ed25519 user certificate blob of key(name) (enough for the order, not signed)."""
    return (_s(b"ssh-ed25519-cert-v01@openssh.com") + _s(b"nonce") + _s(name.encode().ljust(32, b"."))
            + struct.pack(">QI", 1, 1) + _s(b"id") + _s(_s(b"root")) + struct.pack(">QQ", 0, 2**64 - 1)
            + _s(b"") + _s(b"") + _s(b"") + _s(key("ca")) + _s(b"sig"))


def resolved_for(config: Path):
    """`ssh -G` of host `h` under `config`."""
    return Resolver(config).resolve("h", time.monotonic() + 10, "h")


def names(offers: list[Offer]) -> list[tuple[str, bool]]:
    return [(o.name, o.agent) for o in offers]


def test_config_keys_held_by_the_agent_come_first_in_the_agents_order_then_its_others_then_files():
    files = [("a", key("a"), None), ("b", key("b"), ("b-cert.pub", cert("b"))), ("c", key("c"), None)]
    agent = [(key("x"), "x"), (key("b"), "b in agent"), (key("y"), "y"), (key("a"), "a in agent")]
    assert names(order(files, [], agent, False)) == [
        ("b", True), ("a", True), ("x", True), ("y", True), ("b-cert.pub", False), ("c", False)]


def test_identities_only_keeps_back_the_agents_other_keys_not_the_config_keys_it_holds():
    files = [("a", key("a"), None), ("c", key("c"), None)]
    agent = [(key("x"), "x"), (key("c"), "c in agent")]
    assert names(order(files, [], agent, True)) == [("c", True), ("a", False)]


def test_certificate_files_come_first_and_stop_the_cert_beside_a_key():
    files = [("a", key("a"), ("a-cert.pub", cert("a")))]
    got = order(files, [("issued.cert", cert("a")), ("not-a-cert.pub", key("z"))], [(key("x"), "x")], False)
    assert names(got) == [("issued.cert", False), ("x", True), ("a", False)]


def test_a_certificate_the_agent_holds_as_it_lies_on_disk_is_signed_there():
    files = [("a", key("a"), ("a-cert.pub", cert("a")))]
    got = order(files, [], [(key("a"), "a"), (cert("a"), "a cert")], False)
    assert names(got) == [("a", True), ("a-cert.pub", True)]


def test_no_agent_offers_the_files_in_config_order():
    files = [("a", key("a"), ("a-cert.pub", cert("a"))), ("b", key("b"), None)]
    assert names(order(files, [], None, True)) == [("a", False), ("a-cert.pub", False), ("b", False)]


def test_pubkey_accepted_algorithms_leaves_out_what_it_does_not_list():
    rsa = _s(b"ssh-rsa") + _s(b"\x01\x00\x01") + _s(b"n")
    files = [("rsa", rsa, None), ("a", key("a"), ("a-cert.pub", cert("a")))]
    assert names(order(files, [], None, False, ("ssh-ed25519",))) == [("a", False)]
    assert names(order(files, [], None, False, ("rsa-sha2-256", "ssh-ed25519-cert-v01@openssh.com"))) == [
        ("rsa", False), ("a-cert.pub", False)]
    assert len(order(files, [], None, False, None)) == 3


def test_a_certificate_is_signed_by_the_first_identity_with_its_key():
    files = [("a", key("a"), ("a-cert.pub", cert("a")))]
    in_agent = order(files, [], [(key("a"), "a")], False)
    assert signer(in_agent[1], in_agent) == in_agent[0] and in_agent[0].agent
    on_disk = order(files, [], None, False)
    assert signer(on_disk[1], on_disk).key_file == "a" and not signer(on_disk[1], on_disk).agent
    only_cert = [Offer(cert("a"), "issued.cert")]
    assert signer(only_cert[0], only_cert) == only_cert[0]
    assert signer(on_disk[0], on_disk) == on_disk[0]


def test_made_up_blobs_read_back():
    assert pubkey_order.plain_key(cert("a")) == key("a") and pubkey_order.plain_key(key("a")) == key("a")
    info = pubkey_order.cert_info(cert("a"))
    assert (info.kind, info.key_id, info.principals) == (1, "id", ("root",))
    assert pubkey_order.cert_info(key("a")) is None and pubkey_order.cert_info(cert("a")[:60]) is None
    assert pubkey_order.key_type(b"\0\0") == ""
    fido = (_s(b"sk-ssh-ed25519-cert-v01@openssh.com") + _s(b"nonce") + _s(b"pk") + _s(b"ssh:")
            + cert("a")[len(_s(b"ssh-ed25519-cert-v01@openssh.com") + _s(b"nonce") + _s(b"a".ljust(32, b"."))):])
    assert pubkey_order.plain_key(fido) == _s(b"sk-ssh-ed25519@openssh.com") + _s(b"pk") + _s(b"ssh:")
    assert pubkey_order.cert_info(fido).principals == ("root",)


def _blob(path: Path) -> bytes:
    return base64.b64decode(path.read_text().split()[1])


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> Path:
    """A CA and rsa / ecdsa / ed25519 keys with certificates, made by ssh-keygen: user
    certificates for root and bob, valid for an hour, and a host certificate of the rsa key
    (host-cert.pub)."""
    d = tmp_path_factory.mktemp("certs")
    for name, kind in (("ca", "ed25519"), ("rsa", "rsa"), ("ecdsa", "ecdsa"), ("ed25519", "ed25519")):
        subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(d / name)], check=True)
    for name in ("rsa", "ecdsa", "ed25519"):
        subprocess.run(["ssh-keygen", "-q", "-s", str(d / "ca"), "-I", f"id-{name}", "-n", "root,bob", "-V", "-1m:+1h",
                        str(d / f"{name}.pub")], check=True, capture_output=True)
    (d / "host.pub").write_bytes((d / "rsa.pub").read_bytes())
    subprocess.run(["ssh-keygen", "-q", "-s", str(d / "ca"), "-I", "host", "-h", "-n", "h", str(d / "host.pub")],
                   check=True, capture_output=True)
    return d


@pytest.mark.parametrize("name", ["rsa", "ecdsa", "ed25519"])
def test_real_certificates_read_as_ssh_keygen_made_them(real, name):
    c = _blob(real / f"{name}-cert.pub")
    assert pubkey_order.plain_key(c) == _blob(real / f"{name}.pub")
    info = pubkey_order.cert_info(c)
    ca_fp = subprocess.run(["ssh-keygen", "-l", "-f", str(real / "ca.pub")], capture_output=True, text=True,
                           check=True).stdout.split()[1]
    assert (info.kind, info.key_id, info.principals, info.ca) == (1, f"id-{name}", ("root", "bob"), ca_fp)
    assert info.valid_after < time.time() < info.valid_before


def test_a_host_certificate_is_never_offered(real):
    host_cert = _blob(real / "host-cert.pub")
    assert pubkey_order.cert_info(host_cert).kind == 2
    got = order([("rsa", _blob(real / "rsa.pub"), ("rsa-cert.pub", host_cert))], [("h.cert", host_cert)], None, False)
    assert names(got) == [("rsa", False)]


def test_refusal_hint_names_the_principal_the_expiry_or_the_ca(real):
    c = Offer(_blob(real / "ed25519-cert.pub"), "ed.cert")
    assert "lists the principals root, bob, not 'alice'" in pubkey_order.refusal_hint([c], "alice")
    assert "is expired since" in pubkey_order.refusal_hint([c], "root", now=time.time() + 7200)
    assert "not valid before" in pubkey_order.refusal_hint([c], "root", now=time.time() - 7200)
    hint = pubkey_order.refusal_hint([Offer(key("a"), "a"), c], "root")
    assert "TrustedUserCAKeys" in hint and pubkey_order.cert_info(c.blob).ca in hint and "'a'" not in hint
    assert pubkey_order.refusal_hint([Offer(key("a"), "a")], "root") == ""


def test_key_files_read_as_ssh_reads_them(real, tmp_path):
    """authfile.c sshkey_load_public: a passphrase does not hide an openssh-key-v1 file's public
    key; an IdentityFile may name the .pub itself; `KEY-cert.pub` beside it is its certificate."""
    locked = tmp_path / "locked"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "secret", "-f", str(locked)], check=True)
    want = _blob(Path(f"{locked}.pub"))
    Path(f"{locked}.pub").unlink()
    assert keyfiles.public_blob(locked, lambda p: None) == want
    assert keyfiles.public_blob(real / "rsa.pub", lambda p: None) == _blob(real / "rsa.pub")
    assert keyfiles.public_blob(tmp_path / "absent", lambda p: b"caller's") == b"caller's"
    assert keyfiles.beside(real / "rsa") == (str(real / "rsa-cert.pub"), _blob(real / "rsa-cert.pub"))
    assert keyfiles.beside(locked) is None
    (tmp_path / "garbage-cert.pub").write_text("ssh-ed25519-cert-v01@openssh.com AAAA%%%\n")
    assert keyfiles.beside(tmp_path / "garbage") is None


def test_the_ssh_kind_names_a_refused_certificate_on_disk(real, tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text(f"Host h\n  User alice\n  IdentityFile {real / 'ed25519'}\n  IdentityFile {real / 'rsa'}\n")
    r = resolved_for(config)
    hint = keyfiles.file_certificate_hint(r)
    assert hint.count("not 'alice'") == 2 and str(real / "rsa-cert.pub") in hint
    config.write_text(f"Host h\n  User alice\n  IdentityFile {real / 'rsa'}\n  CertificateFile {real / 'ecdsa-cert.pub'}\n")
    hint = keyfiles.file_certificate_hint(resolved_for(config))
    assert "ecdsa-cert.pub" in hint and "rsa-cert.pub" not in hint  # CertificateFile: nothing beside keys
