"""Public-key authentication for the paramiko connection, as OpenSSH's client does it: the keys
`ssh -G` resolved (IdentityFile and the certificate beside each, CertificateFile, the agent at
IdentityAgent, IdentitiesOnly), offered in OpenSSH's order (pubkey_order.py), each signed where
OpenSSH signs it (a certificate on disk by the agent that holds its key, an agent's certificate
by the agent as the agent listed it: paramiko's own AgentKey offers an RSA certificate as the
plain key, paramiko/paramiko#2437). A refusal names the keys offered and, for a certificate,
the likely fix (TrustedUserCAKeys, principals, validity).

Where it differs from `ssh -o BatchMode=yes`: a file key that neither the agent holds nor can be
read without a passphrase is never offered (ssh offers its public half, then cannot sign).
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

from ._paramiko import paramiko  # first: paramiko without invoke (see _paramiko.py)

from . import keyfiles, pubkey_order
from .errors import Unreachable
from .pubkey_order import Offer
from .resolve import Resolved

log = logging.getLogger("fleetctl")


def _private_public(path: Path) -> bytes | None:
    """The public key of a (PEM) private key file paramiko reads without a passphrase, else None."""
    try:
        return paramiko.PKey.from_path(path).asbytes()
    except (paramiko.SSHException, OSError, ValueError):
        return None


class _AgentAt(paramiko.agent.AgentSSH):
    """The SSH agent listening on the unix socket `path` (IdentityAgent), asked within `timeout`
    seconds. Raises OSError when it cannot be reached, paramiko.SSHException when it does not
    list its keys."""

    def __init__(self, path: str, timeout: float):
        super().__init__()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
            self._connect(sock)
        except BaseException:
            sock.close()
            raise

    def close(self) -> None:
        self._close()


class _AgentSigned(paramiko.AgentKey):
    """An offer the agent signs: `offer` (a key or certificate blob) is what the server is sent,
    `signing` the agent's own blob for the private key (the same blob, or the plain key of a
    certificate on disk)."""

    def __init__(self, agent, offer: bytes, signing: bytes):
        super().__init__(agent, signing)
        self.public_blob = paramiko.PublicBlob(pubkey_order.key_type(offer), offer)

    def asbytes(self) -> bytes:  # the agent's blob as listed (AgentKey re-encodes an RSA certificate)
        return self.blob


class OpenSSHAuth:
    """Public keys as OpenSSH offers them to `r` (pubkey_order.order); `timeout`: seconds to
    reach the agent. Given to paramiko's SSHClient.connect as its `auth_strategy` (which calls
    only authenticate(), once connected: nothing is read, and no agent reached, before);
    authenticate() raises Unreachable naming every key refused and, for a certificate, why it
    likely was."""

    def __init__(self, r: Resolved, timeout: float):
        self.r, self.timeout = r, timeout
        self.agent: _AgentAt | None = None
        self.agent_count: int | None = None  # keys the agent listed; None: no agent reached
        self.offers: list[Offer] = []

    def prepare(self) -> list[Offer]:
        """Reach the agent (held open until close()) and read the key files: -> self.offers, in
        OpenSSH's order. An agent that cannot be reached, or an identity file whose public key
        cannot be read, is left out with a warning, as ssh goes on without them."""
        r, agent_keys = self.r, None
        if r.identity_agent:
            try:
                self.agent = _AgentAt(r.identity_agent, self.timeout)
                agent_keys = [(k.blob, k.comment or "agent key") for k in self.agent.get_keys()]
            except (OSError, paramiko.SSHException) as e:
                log.warning("fleetctl: %s: agent %s not used (%s)", r.name, r.identity_agent, e)
        files, certs = keyfiles.identities(r, _private_public)
        for path in set(map(str, r.identity_files)) - {f[0] for f in files}:
            log.warning("fleetctl: %s: identity file %s skipped (no public key readable without a passphrase, "
                        "and no %s.pub)", r.name, path, path)
        self.agent_count = None if agent_keys is None else len(agent_keys)
        self.offers = pubkey_order.order(files, certs, agent_keys, r.identities_only, keyfiles.accepted(r))
        return self.offers

    def close(self) -> None:
        """Let go of the agent (idempotent)."""
        if self.agent is not None:
            self.agent.close()
            self.agent = None

    def _key(self, offer: Offer):
        """A paramiko key that offers `offer` and signs with what OpenSSH signs it with, or None
        (a private key file that cannot be read without a passphrase)."""
        by = pubkey_order.signer(offer, self.offers)
        if by.agent and self.agent is not None:
            return _AgentSigned(self.agent, offer.blob, by.blob)
        if by.key_file is None:
            return None
        try:
            key = paramiko.PKey.from_path(by.key_file)
        except (paramiko.SSHException, OSError, ValueError) as e:
            log.warning("fleetctl: %s: %s not offered: private key %s unreadable (%s)", self.r.name, offer.name,
                        by.key_file, e)
            return None
        key.public_blob = paramiko.PublicBlob(pubkey_order.key_type(offer.blob), offer.blob)
        return key

    def authenticate(self, transport):
        """Offer each key in order until the server accepts one. Raises Unreachable when none is
        accepted, or the server closes the connection first (sshd's MaxAuthTries)."""
        r, refused = self.r, []
        try:
            for offer in self.prepare():
                key = self._key(offer)
                if key is None:
                    continue
                if not transport.is_active():
                    break
                try:
                    transport.auth_publickey(r.user, key)
                    return
                except (paramiko.SSHException, EOFError, OSError):  # AuthenticationException among them
                    refused.append(offer)
        finally:
            self.close()
        raise Unreachable(self.failure(refused, transport.is_active()))

    def failure(self, refused: list[Offer], open_: bool) -> str:
        """The message for a login that failed after `refused` were refused (`open_`: the server
        still had the connection open)."""
        r = self.r
        where = f"{r.user}@{r.hostname}:{r.port}"
        if not refused:
            agent = ("IdentityAgent none" if not r.identity_agent else
                     f"no agent answered at {r.identity_agent}" if self.agent_count is None else
                     f"the agent at {r.identity_agent} holds no keys" if not self.agent_count else
                     f"IdentitiesOnly yes keeps back the agent's {self.agent_count} keys")
            return (f"authentication failed: no key to offer to {where} (IdentityFile: "
                    f"{', '.join(map(str, r.identity_files)) or 'none readable'}; {agent})")
        names = ", ".join(o.name for o in refused)
        msg = f"authentication failed: {where} refused the {len(refused)} key(s) offered ({names})"
        if not open_ and len(refused) < len(self.offers):
            msg += (f"; it closed the connection after {len(refused)} of {len(self.offers)} keys (sshd's MaxAuthTries, "
                    "\"Too many authentication failures\"): name the right key as IdentityFile, with "
                    "IdentitiesOnly yes to keep the agent's other keys back")
        hint = pubkey_order.refusal_hint(refused, r.user)
        return msg + (f"; {hint}" if hint else "")
