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
