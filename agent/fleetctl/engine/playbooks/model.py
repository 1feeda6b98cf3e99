"""Playbooks: YAML files plus Jinja2 templates that say how to change a host, checked on load.

A playbook is data; `fleetctl.engine.playbooks.plan` turns it and one host's facts and findings into a plan.
Schema (every key is checked; an error names the file and line, ParseError, exit 4):

    name: defrag-tier0                      # required
    description: ...                        # optional
    requires:                               # optional; the first false one skips the host
      - that: "facts.sglang is not none"    # Jinja2 expression over host vars, facts, findings
        reason: "sglang is not installed"   # a template -> status skipped, "not applicable: <reason>"
        refuse: true                        # optional: status failed with the reason instead
    tasks:                                  # required, at least one
      - name: ...                           # required
        create_file: {...}                  # exactly one task kind: a key of engine/tasks.TASKS
                                            # (the kind's module gives its mapping's keys)
        notify: [restart sglang]            # handlers to run when this task changes something
    handlers:                               # optional
      - name: restart sglang
        when: "fleetctl_restart_cmd is defined"   # optional
        command: "{{ fleetctl_restart_cmd }}"     # rendered shell command, run by the lead
        wait_for_health_s: 300                    # optional, seconds; 0 = do not wait
    validate:                               # optional; steps run after the change, in order
      - compile                             # or {compile: {when: ...}}
      - reinspect: {that: "finding.expr == 'True'"}   # every edited site, re-read, satisfies it
      - smoke: {offline: "{{ fleetctl_python }} -m sglang.bench_one_batch ..."}   # optional command;
                                            # servers come from inventory vars or discovery
      - load: {profile: pressure}           # the load gate: SGLang's own benchmark client before
                                            # and after (engine/gates/load.py; settings: load.SETTINGS,
                                            # e.g. max_throughput_drop: 0.1, repeat: 2); at most one
      - route                               # the route gate (engine/gates/route.py): every rank routed,
                                            # tokens and logprobs equal to the baseline's; no settings
                                            # but `when`; at most one, after a smoke step
    on_failure: rollback                    # rollback (default) | keep

The playbook and its templates are read as engine/playbooks/reader.py says (sandboxed Jinja2, files only
from inside the playbook's directory, owned by the operator or root). Render context:
the host's inventory vars at top level, plus `host` (inventory name), `facts`, `findings`
and, in per-site templates, `finding` (one inspect finding plus `expr_one_line`).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field

import jinja2
import yaml

from ...errors import ParseError
from ..load import SETTINGS as LOAD_SETTINGS, load_options
from .reader import Expr, Reader, Snippet, TemplateRefused, environment, read_inside
from .tasks import TASKS, Task

VALIDATE_STEPS = ("compile", "reinspect", "smoke", "load", "route")
ON_FAILURE = ("rollback", "keep")


@dataclass
class Requirement:
    that: Expr
    reason: Snippet
    refuse: bool = False


@dataclass
class Handler:
    name: str
    command: Snippet
    when: Expr | None
    wait_for_health_s: int


@dataclass
class ValidateStep:
    step: str  # one of VALIDATE_STEPS
    when: Expr | None = None
    that: Expr | None = None  # reinspect only
    offline: Snippet | None = None  # smoke only: an offline smoke command, rendered per host
    load: dict | None = None  # load only: its settings (engine/load.load_options), checked


@dataclass
class Playbook:
    """A loaded, checked playbook. `path` is the YAML file; `env` renders its templates."""

    name: str
    description: str
    path: str
    requires: list[Requirement]
    tasks: list[Task]
    handlers: dict[str, Handler]
    validate: list[ValidateStep]
    on_failure: str
    env: jinja2.Environment = field(repr=False)


def load_playbook(path: str | os.PathLike) -> Playbook:
    """Load and check a playbook YAML file (schema in the module docstring).

    The file and its templates are read by PlaybookLoader's rules (engine/playbooks/reader.py);
    templates are resolved relative to the playbook's directory and syntax-checked now.
    Raises ParseError "file:line: what" (exit 4) for bad YAML, unknown or missing keys, wrong
    types, bad Jinja2 syntax, missing or refused templates (a symlink, outside the directory, a
    directory or file another user owns or may write) and notify names without a handler; a
    template that `{% include %}`s a refused one raises ParseError "template:line: ..." when rendered.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        text, _ = read_inside(directory, os.path.basename(path), "playbook")
    except jinja2.TemplateNotFound:
        raise ParseError(f"{path}: cannot read playbook: {os.strerror(errno.ENOENT)}") from None
    except TemplateRefused as e:
        raise ParseError(f"{path}: cannot read playbook: {e}") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise ParseError(f"{path}{line}: bad YAML: {getattr(e, 'problem', None) or e}") from None
    if root is None:
        raise ParseError(f"{path}:1: empty playbook")
    env = environment(directory)
    r = Reader(path, env)
    top = r.mapping(root, "playbook", required=("name", "tasks"),
                    optional=("description", "requires", "handlers", "validate", "on_failure"))

    requires = []
    for n in r.seq(top["requires"], "requires") if "requires" in top else []:
        m = r.mapping(n, "requirement", required=("that", "reason"), optional=("refuse",))
        refuse = r.construct.construct_object(m["refuse"]) if "refuse" in m else False
        if not isinstance(refuse, bool):
            raise r.err(m["refuse"], "refuse must be true or false")
        requires.append(Requirement(r.expr(m["that"], "that"), r.inline(m["reason"], "reason"), refuse))

    handlers: dict[str, Handler] = {}
    for n in r.seq(top["handlers"], "handlers") if "handlers" in top else []:
        m = r.mapping(n, "handler", required=("name", "command"), optional=("when", "wait_for_health_s"))
        name = r.scalar(m["name"], "handler name", str)
        if name in handlers:
            raise r.err(m["name"], f"duplicate handler {name!r}")
        handlers[name] = Handler(
            name, r.inline(m["command"], "command"),
            r.expr(m["when"], "when") if "when" in m else None,
            r.scalar(m["wait_for_health_s"], "wait_for_health_s", int) if "wait_for_health_s" in m else 0)

    tasks = []
    for n in r.seq(top["tasks"], "tasks"):
        m = r.mapping(n, "task", required=("name",), optional=("notify", *TASKS))
        kinds = [k for k in TASKS if k in m]
        if len(kinds) != 1:
            raise r.err(n, f"a task has one of {', '.join(TASKS)}")
        notify = []
        for h in r.seq(m["notify"], "notify") if "notify" in m else []:
            hname = r.scalar(h, "notify entry", str)
            if hname not in handlers:
                raise r.err(h, f"notify names no handler: {hname!r}")
            notify.append(hname)
        tasks.append(TASKS[kinds[0]].read(r, m[kinds[0]], r.scalar(m["name"], "task name", str), notify))
    if not tasks:
        raise r.err(top["tasks"], "tasks must not be empty")

    validate = []
    for n in r.seq(top["validate"], "validate") if "validate" in top else []:
        if isinstance(n, yaml.ScalarNode):
            step, opts = r.scalar(n, "validate step", str), {}
        else:
            m = r.mapping(n, "validate step", optional=VALIDATE_STEPS)
            if len(m) != 1:
                raise r.err(n, f"a validate step is one of {', '.join(VALIDATE_STEPS)}")
            (step, body), = m.items()
            opts = r.mapping(body, step, optional={"reinspect": ("when", "that"), "smoke": ("when", "offline"),
                                                   "load": ("when",) + LOAD_SETTINGS}.get(step, ("when",)))
        if step not in VALIDATE_STEPS:
            raise r.err(n, f"unknown validate step {step!r} (known: {', '.join(VALIDATE_STEPS)})")
        load = None
        if step == "load":
            if any(v.step == "load" for v in validate):
                raise r.err(n, "a second load step: a playbook declares at most one load gate")
            load = {k: r.construct.construct_object(v, deep=True) for k, v in opts.items() if k != "when"}
            try:
                load_options(load)
            except ValueError as e:
                raise r.err(n, f"load: {e}") from None
        if step == "route":
            if any(v.step == "route" for v in validate):
                raise r.err(n, "a second route step: a playbook declares at most one route gate")
            if not any(v.step == "smoke" for v in validate):
                raise r.err(n, "the route step runs after the smoke gate passed: put a smoke step before it")
        validate.append(ValidateStep(step, r.expr(opts["when"], "when") if "when" in opts else None,
                                     r.expr(opts["that"], "that") if "that" in opts else None,
                                     r.inline(opts["offline"], "offline") if "offline" in opts else None, load))

    on_failure = r.scalar(top["on_failure"], "on_failure", str) if "on_failure" in top else "rollback"
    if on_failure not in ON_FAILURE:
        raise r.err(top["on_failure"], f"on_failure must be one of {', '.join(ON_FAILURE)}")
    return Playbook(r.scalar(top["name"], "name", str),
                    r.scalar(top["description"], "description", str) if "description" in top else "",
                    path, requires, tasks, handlers, validate, on_failure, env)
