"""Errors that end a fleetctl command, each with its exit code (Ansible's codes).

0 all ok; 2 a host failed; 3 a host unreachable; 4 inventory, playbook or parse error;
5 bad options or a host pattern that matches nothing; 130 interrupted by Ctrl-C.
"""

EXIT_OK = 0
EXIT_FAILED = 2
EXIT_UNREACHABLE = 3
EXIT_PARSE = 4
EXIT_OPTIONS = 5
EXIT_INTERRUPTED = 130  # Ctrl-C: hosts in progress finished, the others were not started
EXIT_TERMINATED = 143  # SIGTERM (128 + 15), handled as Ctrl-C is


class FleetctlError(Exception):
    """An error that stops the whole command; `exit_code` is what the CLI exits with."""

    exit_code = EXIT_FAILED


class HostError(FleetctlError):
    """The root of every failure of one host's job (a failed probe, a busy lock, sudo refusing,
    output too large, a remote deadline, the job's own refusal), which the fan-out reports as
    that host's `failed` and goes on with the others; `Unreachable` (connection.errors) is its
    own branch under it, reported `unreachable`. Raised out of a command (not a host's job),
    it ends the command with `exit_code`."""

    def describe(self, job_timeout: float) -> str:
        """The host's error text in reports, for a job that had `job_timeout` seconds."""
        return str(self)


class HostFailed(HostError):
    """Raised by a job to mark its host failed with a message (no traceback shown)."""


class ProbeFailed(HostError):
    """A probe crashed on the host or printed no result (probes.ProbeError, raised where the
    engine runs probes); the message carries its traceback."""


class InventoryError(FleetctlError):
    """Malformed inventory file: the message names the file and line."""

    exit_code = EXIT_PARSE


class ParseError(FleetctlError):
    """Malformed playbook or kernel package: the message names the file and line."""

    exit_code = EXIT_PARSE


class SshConfigError(FleetctlError):
    """An ssh_config OpenSSH refuses, or one fleetctl cannot honour for a host: the message names
    the host, and the file and line where known."""

    exit_code = EXIT_PARSE


class PatternError(FleetctlError):
    """A host pattern that matches no host, or bad options."""

    exit_code = EXIT_OPTIONS


class UsageError(FleetctlError):
    """Bad command-line options."""

    exit_code = EXIT_OPTIONS
