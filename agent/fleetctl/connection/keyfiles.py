"""OpenSSH's public key and certificate files, read as ssh reads them (no paramiko: the ssh
connection kind reads them too): the public half of each IdentityFile, the certificate beside it,
each CertificateFile.

Source: OpenSSH 9.2 authfile.c `sshkey_load_public()` (the file as a public key line, else
`FILE.pub`, else the public key a private key file carries) and ssh.c
`load_public_identity_files()` (`KEY-cert`, `KEY-cert.pub` beside each IdentityFile).
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path

from . import pubkey_order
from .resolve import Resolved

# Bytes of a public key or certificate file read at most (an RSA 16384-bit certificate is ~5 KiB).
PUBLIC_FILE_MAX = 65536
_OPENSSH_KEY = "-----BEGIN OPENSSH PRIVATE KEY-----"
_OPENSSH_MAGIC = b"openssh-key-v1\0"


def public_line(path: Path) -> bytes | None:
    """The blob of a one-line OpenSSH public key or certificate file (`TYPE BASE64 [comment]`),
    None when `path` is no such file."""
    try:
        if not path.is_file() or path.stat().st_size > PUBLIC_FILE_MAX:
            return None
        words = path.read_text(encoding="ascii", errors="replace").split()
        blob = base64.b64decode(words[1], validate=True) if len(words) >= 2 else b""
    except (OSError, ValueError):
        return None
    return blob if blob and pubkey_order.key_type(blob) == words[0] else None


def _openssh_private_public(path: Path) -> bytes | None:
    """The public key an openssh-key-v1 private key file holds in the clear (before its
    possibly encrypted private part: PROTOCOL.key), None for another file."""
    try:
        text = path.read_text(encoding="ascii", errors="replace")
        if not text.lstrip().startswith(_OPENSSH_KEY):
            return None
        raw = base64.b64decode("".join(text.strip().splitlines()[1:-1]))
        if not raw.startswith(_OPENSSH_MAGIC):
            return None
        _, pos = pubkey_order.ssh_strings(raw, len(_OPENSSH_MAGIC), 3)  # ciphername, kdfname, kdfoptions
        (pub,), _ = pubkey_order.ssh_strings(raw, pos + 4, 1)  # after the uint32 key count
    except (OSError, ValueError):
        return None
    return pub[4:]


def public_blob(path: Path, private_public: Callable[[Path], bytes | None]) -> bytes | None:
    """The public key blob of identity file `path` as sshkey_load_public finds it: the file as a
    public key line, else `PATH.pub`, else the public half of an openssh-key-v1 private key (a
    passphrase does not hide it), else `private_public(path)` (a PEM private key read by the
    caller); None when none reads."""
    for blob in (public_line(path), public_line(Path(f"{path}.pub")), _openssh_private_public(path)):
        if blob is not None:
            return blob
    return private_public(path)


def beside(path: Path) -> tuple[str, bytes] | None:
    """The certificate ssh loads beside identity file `path`, as (its path, its blob):
    `PATH-cert`, else `PATH-cert.pub`; None when neither holds a certificate."""
    for candidate in (Path(f"{path}-cert"), Path(f"{path}-cert.pub")):
        blob = public_line(candidate)
        if blob is not None and pubkey_order.key_type(blob).endswith(pubkey_order.CERT_SUFFIX):
            return str(candidate), blob
    return None


def accepted(r: Resolved) -> tuple[str, ...] | None:
    """PubkeyAcceptedAlgorithms as `ssh -G` printed it for `r`, None when it printed none (the
    fallback reader): for pubkey_order.order."""
    value = r.options.get("pubkeyacceptedalgorithms")
    return tuple(value[0].split(",")) if value else None


def identities(r: Resolved, private_public: Callable[[Path], bytes | None] = lambda p: None
               ) -> tuple[list[tuple[str, bytes, tuple[str, bytes] | None]], list[tuple[str, bytes]]]:
    """`r`'s identity files and certificate files in the shapes pubkey_order.order takes: each
    IdentityFile whose public key reads (public_blob) with the certificate beside it, and each
    CertificateFile that holds a key."""
    files = []
    for path in r.identity_files:
        blob = public_blob(path, private_public)
        if blob is not None:
            files.append((str(path), blob, beside(path)))
    return files, [(str(p), b) for p in r.certificate_files if (b := public_line(p)) is not None]


def file_certificate_hint(r: Resolved) -> str:
    """pubkey_order.refusal_hint for the certificates ssh offers from files for `r` (""
    when it offers none): for a login the ssh connection kind saw refused."""
    files, certs = identities(r)
    offers = pubkey_order.order(files, certs, None, False, accepted(r))
    return pubkey_order.refusal_hint([o for o in offers if o.is_cert], r.user)
