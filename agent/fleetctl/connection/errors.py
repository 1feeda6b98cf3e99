"""What can go wrong reaching a host, typed once for every connection kind: each a per-host
failure (errors.HostError), and Unreachable its own branch (Ansible's "unreachable")."""

from ..errors import EXIT_UNREACHABLE, HostError


class Unreachable(HostError):
    """The host could not be reached, authenticated with, or the connection was lost
    (Ansible's "unreachable")."""

    exit_code = EXIT_UNREACHABLE


class HostKeyRefused(Unreachable):
    """The host's key is unknown (without accept_new), revoked, vouched for only by a CA, or
    differs from known_hosts; nothing was run."""


class RemoteTimeout(HostError):
    """A remote command ran past its deadline; it was killed on the host."""

    def describe(self, job_timeout: float) -> str:
        """"deadline (N s) passed: <what>", N the job's seconds."""
        return f"deadline ({job_timeout:g} s) passed: {self}"


class LockBusy(HostError):
    """Another fleetctl run holds the host's lock. `holder`: the lock's owner line as the host
    wrote it ("USER@HOST pid N since TIME", Connection.hold_lock), "" when unknown."""

    def __init__(self, message: str, holder: str = ""):
        super().__init__(message)
        self.holder = holder


class BecomeFailed(HostError):
    """sudo did not start the command (a wrong or missing password, no sudo rights, a sudo that
    requires a tty, a question in its own words or a second one after the password), or the
    host's ansible_become_exe / ansible_become_flags is one fleetctl does not run (named with
    its file:line and why, before anything starts); nothing ran as the become user. The message
    quotes sudo's own words, bounded and escaped."""


class OutputTooLarge(HostError):
    """A remote command printed more than the controller holds (connection.base.OUTPUT_MAX);
    it was stopped."""


# What each kind of connection failure says, with the fix it names (every connection kind uses
# these; the host-key refusals are HostKeyRefused's, written where the key is checked):
#
#   kind                 message
#   identity file        identity file PATH does not exist: fix ansible_ssh_private_key_file (FILE:LINE)
#                        (or IdentityFile in ssh_config, when that named it); then the auth failure's words
#   port closed          connection refused on HOST:PORT: is sshd listening there? check ansible_port
#                        (or Port in ssh_config) and ansible_host
#   no address           cannot resolve HOST (...): check ansible_host (or HostName in ssh_config)
#   user/auth refused    authentication failed: USER@HOST:PORT refused the N key(s) offered (K, ...)
#                        (paramiko_auth's words): AUTH_FIX
#   proxy failed         ProxyCommand `CMD` exited N before an SSH session: <stderr tail>: fix
#                        ProxyCommand in ssh_config
#   timeout              stalled in the PHASE phase after S s (connect timeout T s): <what that phase
#                        waited for>; each phase of trace.PHASES has its own words (STALLED)

# What a connection waits for in each phase (trace.PHASES), for the message naming the one that stalled.
STALLED = {
    "resolve": "ssh -G did not finish (a Match exec command, or DNS for CanonicalizeHostname?)",
    "connect": "no TCP answer from {where} (host down, a firewall dropping packets, or the wrong ansible_host?)",
    "banner": "TCP to {where} is open but no SSH banner came (sshd stopped or overloaded, MaxStartups, "
              "or no SSH server on that port: check ansible_port)",
    "kex": "the key exchange with {where} did not finish",
    "auth": "{where} did not answer authentication (an agent that never answers, or a slow PAM/LDAP on the host)",
    "open-session": "{where} did not open a session channel (sshd's MaxSessions, or a host under heavy load)",
}
# Characters of a proxy command's stderr kept in a message (its last ones).
PROXY_STDERR_MAX = 400


def identity_missing(path: str, named_by: str) -> str:
    """The message for an identity file that does not exist; `named_by`: where it was named
    ("ansible_ssh_private_key_file (hosts.yaml:19)", "IdentityFile in ssh_config")."""
    return f"identity file {path} does not exist: fix {named_by}"


def refused(host: str, port: int) -> str:
    """The message for a TCP connection refused (nothing listens on `port`)."""
    return (f"connection refused on {host}:{port}: is sshd listening there? check ansible_port "
            "(or Port in ssh_config) and ansible_host")


def unresolvable(host: str, why: str) -> str:
    """The message for a host name DNS (or /etc/hosts) does not know."""
    return f"cannot resolve {host} ({why}): check ansible_host (or HostName in ssh_config)"


# The fix a refused login calls for, after the words that name the user and the keys refused
# (paramiko_auth.OpenSSHAuth.failure, OpenSSH's "Permission denied (publickey)").
AUTH_FIX = "check ansible_user and ansible_ssh_private_key_file (or User / IdentityFile in ssh_config)"


def proxy_failed(command: str, code: int, stderr: str) -> str:
    """The message for a ProxyCommand that exited (with `code`) before an SSH session: the last
    PROXY_STDERR_MAX characters of its `stderr`, escaped (control characters as \\xNN)."""
    tail = stderr.strip()[-PROXY_STDERR_MAX:]
    tail = "".join(c if c.isprintable() or c == " " else f"\\x{ord(c):02x}" for c in tail)
    return (f"ProxyCommand `{command}` exited {code} before an SSH session"
            + (f": {tail}" if tail else " (nothing on its stderr)") + ": fix ProxyCommand in ssh_config")


def stalled(phase: str, seconds: float, connect_timeout: float, where: str) -> str:
    """The message for a connect that ran out of time in `phase` (trace.PHASES), which had
    lasted `seconds` when the `connect_timeout` (seconds) ran out; `where`: HOST:PORT."""
    return (f"stalled in the {phase} phase after {seconds:.1f} s (connect timeout {connect_timeout:g} s): "
            + STALLED[phase].format(where=where))
