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
    """Another fleetctl run holds the host's lock."""


class BecomeFailed(HostError):
    """sudo did not start the command (a wrong or missing password, no sudo rights, a sudo that
    requires a tty, a question in its own words or a second one after the password), or the
    host's ansible_become_exe / ansible_become_flags is one fleetctl does not run (named with
    its file:line and why, before anything starts); nothing ran as the become user. The message
    quotes sudo's own words, bounded and escaped."""


class OutputTooLarge(HostError):
    """A remote command printed more than the controller holds (connection.base.OUTPUT_MAX);
    it was stopped."""
