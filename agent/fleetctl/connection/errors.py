"""What can go wrong reaching a host, typed once for every connection kind."""


class Unreachable(Exception):
    """The host could not be reached, authenticated with, or the connection was lost
    (Ansible's "unreachable")."""


class HostKeyRefused(Unreachable):
    """The host's key is unknown (without accept_new), revoked, vouched for only by a CA, or
    differs from known_hosts; nothing was run."""


class RemoteTimeout(Exception):
    """A remote command ran past its deadline; it was killed on the host."""


class LockBusy(Exception):
    """Another fleetctl run holds the host's lock."""


class BecomeFailed(Exception):
    """sudo did not start the command (a wrong or missing password, no sudo rights, a sudo that
    requires a tty); nothing ran as the become user. The message is sudo's own, bounded."""


class OutputTooLarge(Exception):
    """A remote command printed more than the controller holds (connection.base.OUTPUT_MAX);
    it was stopped."""
