"""A playbook's task kinds: one table, TASKS, from the key a task's YAML names its kind by to the
dataclass of that kind. Adding a kind is a module here (the dataclass, how it is read, how it is
planned) and a row in TASKS; the loader (engine/playbooks/model.py) and the planner (engine/playbooks/plan.py)
ask nothing else of it.

Each kind's dataclass is a `Task`: it has the task's `name` and `notify` (handler names), is read
from its YAML mapping by the classmethod `read`, is planned for one host by `plan` (what it
changes goes into the Work; True when something is to change), and names the inspect findings it
edits by `sites` (the ones validate's `reinspect` checks). Each module documents its keys.
"""

from __future__ import annotations

from typing import Protocol

from ..reader import Reader
from .create import CreateTask
from .edit import EditTask
from .insert import InsertTask
from .work import Work


class Task(Protocol):
    """What every task kind's dataclass is (see the module docstring)."""

    name: str
    notify: list[str]

    @classmethod
    def read(cls, r: Reader, node, name: str, notify: list[str]) -> "Task":
        """The task from its kind's YAML mapping `node` (`name`, `notify` read already). Raises
        ParseError "file:line: ..."."""

    def plan(self, work: Work) -> bool:
        """Plan this task on one host into `work`: True when something is to change. Raises
        PlanRefused (or hostpaths.Refused) when the host's inputs allow no safe plan, ParseError
        for a template or expression error."""

    def sites(self, findings: dict) -> list[dict]:
        """The findings (of `findings`, inspect's) whose sites this task edits in place."""


# key in the playbook -> the kind's dataclass; the order is the one error messages list them in
TASKS: dict[str, type[Task]] = {"edit_expressions": EditTask, "create_file": CreateTask, "insert_text": InsertTask}
