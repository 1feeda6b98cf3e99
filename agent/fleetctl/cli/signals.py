"""How the CLI turns SIGTERM into an exit code: SIGTERM (a CI cancel, GNU `timeout`, a service
stop) is handled as Ctrl-C (hosts in progress finish, none start) and the run's exit code is
then 143 (errors.EXIT_TERMINATED, 128 + 15) where Ctrl-C's is 130: the same code in the run's
--json document, its history record and the process's exit status."""

from __future__ import annotations

import signal

from ..errors import EXIT_INTERRUPTED, EXIT_TERMINATED

_terminated: list[int] = []  # the SIGTERMs received, by on_sigterm


def on_sigterm(signum, frame) -> None:
    """The SIGTERM handler (install()): records the signal and raises KeyboardInterrupt, as
    Ctrl-C's default handler does."""
    _terminated.append(signum)
    raise KeyboardInterrupt


def install() -> None:
    """Handle SIGTERM with on_sigterm in this process (its main thread only: signal(2))."""
    signal.signal(signal.SIGTERM, on_sigterm)


def exit_code(code: int) -> int:
    """Exit code `code` as this run ends with it: an interrupted run's (errors.EXIT_INTERRUPTED,
    130) becomes errors.EXIT_TERMINATED (143) once a SIGTERM was received; any other code stands."""
    return EXIT_TERMINATED if _terminated and code == EXIT_INTERRUPTED else code
