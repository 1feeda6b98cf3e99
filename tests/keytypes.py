"""Public host keys of the types paramiko cannot read, for known_hosts lines in tests: the FIDO
types sk-ssh-ed25519@openssh.com and sk-ecdsa-sha2-nistp256@openssh.com (OpenSSH's PROTOCOL.u2f:
`ssh-keygen -t ed25519-sk` needs a security key, but the public half is only its wire format over
a real curve point) and ssh-dss (RFC 4253 6.6; paramiko 4 dropped DSA). Built from real keys made
by `cryptography`, so OpenSSH's own parser (`ssh-keygen -F`) reads every one."""

from __future__ import annotations

import base64
import struct

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed25519

SK_ED25519 = "sk-ssh-ed25519@openssh.com"
SK_ECDSA = "sk-ecdsa-sha2-nistp256@openssh.com"
DSS = "ssh-dss"
TYPES = (SK_ED25519, SK_ECDSA, DSS)


def _string(b: bytes) -> bytes:
    return struct.pack(">I", len(b)) + b


def _mpint(n: int) -> bytes:
    return _string(n.to_bytes(n.bit_length() // 8 + 1, "big"))  # a leading zero byte keeps it positive


def public_key(keytype: str) -> str:
    """A fresh public key of `keytype` (one of TYPES) as known_hosts writes it: "TYPE BASE64"."""
    raw = serialization.Encoding.Raw, serialization.PublicFormat.Raw
    if keytype == SK_ED25519:
        point = ed25519.Ed25519PrivateKey.generate().public_key().public_bytes(*raw)
        blob = _string(keytype.encode()) + _string(point) + _string(b"ssh:")
    elif keytype == SK_ECDSA:
        point = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
            serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)
        blob = _string(keytype.encode()) + _string(b"nistp256") + _string(point) + _string(b"ssh:")
    elif keytype == DSS:
        n = dsa.generate_private_key(1024).public_key().public_numbers()
        p = n.parameter_numbers
        blob = _string(keytype.encode()) + _mpint(p.p) + _mpint(p.q) + _mpint(p.g) + _mpint(n.y)
    else:
        raise ValueError(f"no builder for key type {keytype!r}")
    return f"{keytype} {base64.b64encode(blob).decode()}"
