"""A fleet run's progress on stderr: which host is in which phase of its job.

    RunProgress(label, total, console, mode)  mode "bar" (a terminal): Rich's bar for the hosts
        done, and under it a line per host in progress with its current phase; mode "lines"
        (FLEETCTL_PROGRESS=lines: a log, CI, a pipe): one plain line per phase a host enters and
        one when it finishes, with its status and seconds; mode None: nothing.

The phases are the ones jobs name through engine.context.HostContext.phase: PHASES, a
phase possibly followed by ": detail" (the handler's name for restart).
"""

from __future__ import annotations

import threading

from rich.console import Console
from rich.markup import escape

# The phases a host's job goes through (not every job has each): opening the connection, the
# inspect probes, a kernel's build, publish, reference test and mark (probes/kernel/kbuild.py
# actions), a change's restart handlers, its gates (health wait, smoke, load).
PHASES = ("connect", "gather", "build", "publish", "test", "mark", "restart", "gate")
MODES = ("bar", "lines")


class RunProgress:
    """The progress of one Fleet.run over `total` hosts, labelled `label`, on `console`, in
    `mode` (MODES, or None: nothing shown). phase() and done() are called from the run's worker
    threads; start() and stop() from the thread that runs it."""

    def __init__(self, label: str, total: int, console: Console, mode: str | None):
        if mode not in (None, *MODES):
            raise ValueError(f"progress mode {mode!r}: one of {MODES} or None")
        self.label, self.total, self.console, self.mode = label, total, console, mode
        self._lock = threading.Lock()
        self._bar = None
        self._tasks: dict[str, int] = {}
        self._done = 0

    def start(self) -> None:
        if self.mode == "bar":
            # imported only for a bar (a terminal): 26 ms of a --json run's start otherwise
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=self.console, transient=True)
            self._bar.start()
            self._overall = self._bar.add_task(self.label, total=self.total)

    def phase(self, host: str, name: str) -> None:
        """Host `host` enters phase `name`."""
        with self._lock:
            if self._bar is not None:
                text = f"  {escape(host)}: {escape(name)}"
                if host in self._tasks:
                    self._bar.update(self._tasks[host], description=text)
                else:
                    self._tasks[host] = self._bar.add_task(text, total=None)
            elif self.mode == "lines":
                self.console.print(f"{self.label}: {escape(host)}: {escape(name)}", highlight=False, soft_wrap=True)

    def done(self, host: str, status: str, elapsed_s: float) -> None:
        """Host `host` finished with HostStatus `status` after `elapsed_s` seconds."""
        with self._lock:
            self._done += 1
            if self._bar is not None:
                task = self._tasks.pop(host, None)
                if task is not None:
                    self._bar.remove_task(task)
                self._bar.advance(self._overall)
            elif self.mode == "lines":
                self.console.print(f"{self.label}: {escape(host)}: {escape(status)} ({elapsed_s:.1f} s; "
                                   f"{self._done}/{self.total} done)", highlight=False, soft_wrap=True)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
