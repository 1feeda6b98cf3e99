"""Which public keys OpenSSH offers, in which order, and what signs each: pure (key blobs in,
a plan out), for the paramiko connection (paramiko_auth.py), so that it logs in where `ssh`
logs in and offers no key `ssh` would not (a wrong key offered first counts against sshd's
MaxAuthTries: "Too many authentication failures").

Source: OpenSSH 9.2 (Debian 12's client), sshconnect2.c:
- `pubkey_prepare()`: "try keys in the following order: 1. certificates listed in the config
  file 2. other input certificates 3. agent keys that are found in the config file 4. other
  agent keys 5. keys that are only listed in the config file". In code: the CertificateFile
  user certificates first; then, in the agent's own order, each agent key equal to an
  IdentityFile entry (that entry moves up and is signed by the agent); then the agent's other
  keys, dropped with `IdentitiesOnly yes`; then the IdentityFile entries the agent does not
  hold, in config order.
- ssh.c `load_public_identity_files()`: each IdentityFile entry is followed by `KEY-cert`
  (`KEY-cert.pub`) when that file holds a certificate, only where no CertificateFile is set.
- `sign_and_send_pubkey()`: a certificate is signed by the first identity in that order with the
  same public key and another type ("using private key ... from agent for certificate"), else by
  itself.
Certificates: PROTOCOL.certkeys (the blob's fields), to say why a server refused one.
"""

from __future__ import annotations

import base64
import hashlib
import struct
import time
from dataclasses import dataclass, replace

CERT_SUFFIX = "-cert-v01@openssh.com"
# Public-key fields after the type (and, in a certificate, the nonce), per key type (PROTOCOL.certkeys,
# PROTOCOL.u2f): RSA e n, DSA p q g y, ECDSA curve Q, ed25519 pk, FIDO keys with their application.
_KEY_FIELDS = {"ssh-rsa": 2, "ssh-dss": 4, "ecdsa-sha2-nistp256": 2, "ecdsa-sha2-nistp384": 2,
               "ecdsa-sha2-nistp521": 2, "ssh-ed25519": 1, "sk-ecdsa-sha2-nistp256@openssh.com": 3,
               "sk-ssh-ed25519@openssh.com": 2}
USER_CERT = 1  # SSH2_CERT_TYPE_USER


@dataclass(frozen=True)
class Offer:
    """One public key or certificate to offer.

    blob: the public key / certificate blob sent in the userauth request. name: where it came
    from, for messages (a file path, or the agent's comment). agent: the ssh-agent holds this
    very blob (it signs there). key_file: the private key file that signs for it when the agent
    does not (an IdentityFile, also for the certificate beside it), None: none."""

    blob: bytes
    name: str
    agent: bool = False
    key_file: str | None = None

    @property
    def is_cert(self) -> bool:
        return key_type(self.blob).endswith(CERT_SUFFIX)


@dataclass(frozen=True)
class CertInfo:
    """What a user certificate says (PROTOCOL.certkeys): kind 1 user / 2 host, key_id, principals
    (empty: any user), valid_after / valid_before (seconds since the epoch; 0 / 2**64-1 for
    always), ca: the signing CA's SHA256 fingerprint ("SHA256:..." as ssh-keygen -l prints)."""

    kind: int
    key_id: str
    principals: tuple[str, ...]
    valid_after: int
    valid_before: int
    ca: str


def ssh_strings(blob: bytes, pos: int, n: int) -> tuple[list[bytes], int]:
    """`n` SSH strings (uint32 length, bytes) of `blob` from `pos`; -> (their raw encodings, end).
    Raises ValueError for a truncated blob."""
    out = []
    for _ in range(n):
        if pos + 4 > len(blob):
            raise ValueError("truncated key blob")
        size = struct.unpack(">I", blob[pos:pos + 4])[0]
        if pos + 4 + size > len(blob):
            raise ValueError("truncated key blob")
        out.append(blob[pos:pos + 4 + size])
        pos += 4 + size
    return out, pos


def _string(value: bytes) -> bytes:
    return struct.pack(">I", len(value)) + value


def key_type(blob: bytes) -> str:
    """The type name a key blob starts with ("ssh-ed25519", "ssh-rsa-cert-v01@openssh.com"...);
    "" for a blob too short to have one."""
    try:
        (raw,), _ = ssh_strings(blob, 0, 1)
    except ValueError:
        return ""
    return raw[4:].decode("ascii", "replace")


def _base(name: str) -> str | None:
    """The plain key type of certificate type `name` (`sk-ssh-ed25519-cert-v01@openssh.com` ->
    `sk-ssh-ed25519@openssh.com`), None for a type that is no certificate known here."""
    if not name.endswith(CERT_SUFFIX):
        return None
    stem = name[:-len(CERT_SUFFIX)]
    base = f"{stem}@openssh.com" if f"{stem}@openssh.com" in _KEY_FIELDS else stem
    return base if base in _KEY_FIELDS else None


def plain_key(blob: bytes) -> bytes:
    """The plain public key blob of a certificate (its type without -cert-v01, its key fields
    without the nonce), or `blob` itself when it is no certificate or of a type not known here
    (then it equals only itself)."""
    base = _base(key_type(blob))
    if base is None:
        return blob
    try:
        (_, _nonce), pos = ssh_strings(blob, 0, 2)
        fields, _ = ssh_strings(blob, pos, _KEY_FIELDS[base])
    except ValueError:
        return blob
    return _string(base.encode()) + b"".join(fields)


def cert_info(blob: bytes) -> CertInfo | None:
    """What the certificate `blob` says; None when it is no certificate this module can read."""
    base = _base(key_type(blob))
    if base is None:
        return None
    try:
        _, pos = ssh_strings(blob, 0, 2 + _KEY_FIELDS[base])
        if pos + 12 > len(blob):
            return None
        kind = struct.unpack(">I", blob[pos + 8:pos + 12])[0]
        (key_id, principals), pos = ssh_strings(blob, pos + 12, 2)
        if pos + 16 > len(blob):
            return None
        after, before = struct.unpack(">QQ", blob[pos:pos + 16])
        (_, _, _, ca), _ = ssh_strings(blob, pos + 16, 4)
        names, at = [], 0
        packed = principals[4:]
        while at < len(packed):
            (one,), at = ssh_strings(packed, at, 1)
            names.append(one[4:].decode("utf-8", "replace"))
    except ValueError:
        return None
    digest = base64.b64encode(hashlib.sha256(ca[4:]).digest()).decode().rstrip("=")
    return CertInfo(kind, key_id[4:].decode("utf-8", "replace"), tuple(names), after, before, f"SHA256:{digest}")


def allowed(blob: bytes, accepted: tuple[str, ...] | None) -> bool:
    """Whether PubkeyAcceptedAlgorithms (`accepted`, as `ssh -G` prints it; None: any) lets ssh
    offer the key `blob` (sshconnect2.c key_type_allowed_by_config: an RSA key or certificate by
    any of its signature algorithms)."""
    if accepted is None:
        return True
    name = key_type(blob)
    rsa = {"ssh-rsa": ("rsa-sha2-512", "rsa-sha2-256"),
           "ssh-rsa" + CERT_SUFFIX: ("rsa-sha2-512" + CERT_SUFFIX, "rsa-sha2-256" + CERT_SUFFIX)}
    return name in accepted or any(a in accepted for a in rsa.get(name, ()))


def order(identity_files: list[tuple[str, bytes, tuple[str, bytes] | None]],
          certificate_files: list[tuple[str, bytes]], agent: list[tuple[bytes, str]] | None,
          identities_only: bool, accepted: tuple[str, ...] | None = None) -> list[Offer]:
    """The keys OpenSSH offers, in its order (pubkey_prepare, see the module's docstring).

    identity_files: each IdentityFile as `ssh -G` lists them, as (path, its public key blob, the
    certificate found beside it as (path, blob) or None). certificate_files: each CertificateFile
    as (path, blob). agent: the agent's keys as (blob, comment) in the agent's order, None for no
    agent. accepted: PubkeyAcceptedAlgorithms (see allowed()): a key it does not accept is left
    out (pubkey_prepare's last filter). A certificate that is not a user certificate (a
    host certificate) is left out, as ssh leaves it out."""
    def usable(blob: bytes) -> bool:
        info = cert_info(blob) if key_type(blob).endswith(CERT_SUFFIX) else None
        return info is None or info.kind == USER_CERT

    files: list[Offer] = []
    for path, blob, beside in identity_files:
        files.append(Offer(blob, path, key_file=path))
        if beside is not None and not certificate_files and usable(beside[1]):
            files.append(Offer(beside[1], beside[0], key_file=path))
    preferred = [Offer(blob, path) for path, blob in certificate_files if key_type(blob).endswith(CERT_SUFFIX)
                 and usable(blob)]
    others = []
    for blob, comment in agent or ():
        match = next((f for f in files if f.blob == blob), None)
        if match is not None:
            files.remove(match)
            preferred.append(replace(match, agent=True))
        elif not identities_only:
            others.append(Offer(blob, comment, agent=True))
    return [o for o in (*preferred, *others, *files) if allowed(o.blob, accepted)]


def signer(offer: Offer, offers: list[Offer]) -> Offer:
    """What signs for `offer`: for a certificate, the first of `offers` with the same public key
    and another type (sign_and_send_pubkey), else the offer itself."""
    if offer.is_cert:
        plain = plain_key(offer.blob)
        for other in offers:
            if not other.is_cert and plain_key(other.blob) == plain:
                return other
    return offer


def refusal_hint(refused: list[Offer], user: str, now: float | None = None) -> str:
    """Why a server most likely refused the certificates among `refused` for `user`, and the way
    out, one clause per certificate ("" when none was offered); `now`: seconds since the epoch."""
    now = time.time() if now is None else now
    out = []
    for o in refused:
        info = cert_info(o.blob) if o.is_cert else None
        if info is None:
            continue
        what = f"certificate {o.name} (key id {info.key_id!r})"
        if info.principals and user not in info.principals:
            out.append(f"{what} lists the principals {', '.join(info.principals)}, not {user!r}: sign it again "
                       f"with `ssh-keygen -s CA -n {user} ...`, or log in as one of them (ansible_user)")
        elif now < info.valid_after or now >= info.valid_before:
            bound = info.valid_before if now >= info.valid_before else info.valid_after
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(min(bound, 253402300799)))
            out.append(f"{what} is {'expired since' if now >= info.valid_before else 'not valid before'} {when}: "
                       "renew it")
        else:
            out.append(f"{what} was refused: the host's sshd must trust its CA ({info.ca}) in TrustedUserCAKeys, "
                       f"and list {user!r} in AuthorizedPrincipalsFile where one is set")
    return "; ".join(out)
