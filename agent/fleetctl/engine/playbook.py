"""Playbooks: YAML files plus Jinja2 templates that say how to change a host, checked on load.

A playbook is data; `fleetctl.engine.plan` turns it and one host's facts and findings into a plan.
Schema (every key is checked; an error names the file and line, ParseError, exit 4):

    name: defrag-tier0                      # required
    description: ...                        # optional
    requires:                               # optional; the first false one skips the host
      - that: "facts.sglang is not none"    # Jinja2 expression over host vars, facts, findings
        reason: "sglang is not installed"   # -> status skipped, "not applicable: <reason>"
    tasks:                                  # required, at least one
      - name: ...
        edit_expressions:                   # replace the value span of selected inspect findings
          findings: need_sort_origins       # key of the inspect findings holding the sites
          when: "not finding.literal"       # which findings to change (expression over `finding`)
          value: templates/x/value.py.j2    # renders the new Python expression
          comment: templates/x/comment.j2   # renders the one-line trailing comment
          marker: "fleetctl x:"             # text in that comment that marks an applied edit
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
    on_failure: rollback                    # rollback (default) | keep

Templates render in Jinja2's ImmutableSandboxedEnvironment with StrictUndefined from the
playbook's directory (FileSystemLoader): a playbook from a colleague cannot run code on the
control machine (no `__class__`/`__globals__` walks, no calls that mutate); an undefined
variable or a sandbox violation raises ParseError naming the template file and line. Render context:
the host's inventory vars at top level, plus `host` (inventory name), `facts`, `findings`
and, in per-site templates, `finding` (one inspect finding plus `expr_one_line`).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from typing import Any

import jinja2
import jinja2.sandbox
import yaml

from ..errors import ParseError

VALIDATE_STEPS = ("compile", "reinspect", "smoke")
ON_FAILURE = ("rollback", "keep")


def _where(exc: BaseException, filename: str | None) -> int | None:
    """The template line of the innermost traceback frame that belongs to `filename`."""
    line, tb = None, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


@dataclass
class Snippet:
    """A Jinja2 template (file or inline YAML string) that renders to text; `where` is "file:line"."""

    template: jinja2.Template
    where: str

    def render(self, ctx: dict[str, Any]) -> str:
        """Render with `ctx`, stripped. Raises ParseError "file:line: message" on any template error."""
        try:
            return self.template.render(ctx).strip()
        except Exception as e:  # noqa: BLE001 - every template failure is the playbook's fault
            line = _where(e, self.template.filename)
            if self.template.filename and self.template.filename != "<template>" and line:
                where = f"{self.template.filename}:{line}"
            else:
                where = self.where
            raise ParseError(f"{where}: {getattr(e, 'message', None) or e}") from None


@dataclass
class Expr:
    """A Jinja2 expression from the playbook (`when`, `that`); `where` is "file:line"."""

    source: str
    where: str
    fn: Any

    def __call__(self, ctx: dict[str, Any]) -> Any:
        """Evaluate with `ctx`. Raises ParseError "file:line: message" (undefined names included)."""
        try:
            return self.fn(**ctx)
        except Exception as e:  # noqa: BLE001
            raise ParseError(f"{self.where}: {self.source!r}: {getattr(e, 'message', None) or e}") from None


@dataclass
class Requirement:
    that: Expr
    reason: str


@dataclass
class EditTask:
    """Replace the value expression of each selected finding; see the module docstring."""

    name: str
    findings: str
    when: Expr
    value: Snippet
    comment: Snippet
    marker: str
    notify: list[str]


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


@dataclass
class Playbook:
    """A loaded, checked playbook. `path` is the YAML file; `env` renders its templates."""

    name: str
    description: str
    path: str
    requires: list[Requirement]
    tasks: list[EditTask]
    handlers: dict[str, Handler]
    validate: list[ValidateStep]
    on_failure: str
    env: jinja2.Environment = field(repr=False)


class _Reader:
    """Turns yaml nodes into checked values; every error names file:line."""

    def __init__(self, path: str, env: jinja2.Environment):
        self.path, self.env = path, env
        self.construct = yaml.constructor.SafeConstructor()

    def where(self, node: yaml.Node) -> str:
        return f"{self.path}:{node.start_mark.line + 1}"

    def err(self, node: yaml.Node, msg: str) -> ParseError:
        return ParseError(f"{self.where(node)}: {msg}")

    def mapping(self, node, what, required=(), optional=()) -> dict[str, yaml.Node]:
        if not isinstance(node, yaml.MappingNode):
            raise self.err(node, f"{what} must be a mapping")
        out: dict[str, yaml.Node] = {}
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else None
            if key not in (*required, *optional):
                raise self.err(k, f"unknown key {key!r} in {what} (known: {', '.join((*required, *optional))})")
            if key in out:
                raise self.err(k, f"duplicate key {key!r} in {what}")
            out[key] = v
        missing = [k for k in required if k not in out]
        if missing:
            raise self.err(node, f"{what} lacks {', '.join(missing)}")
        return out

    def seq(self, node, what) -> list[yaml.Node]:
        if not isinstance(node, yaml.SequenceNode):
            raise self.err(node, f"{what} must be a list")
        return node.value

    def scalar(self, node, what, kind):
        value = self.construct.construct_object(node, deep=True) if isinstance(node, yaml.ScalarNode) else node
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.err(node, f"{what} must be {'a string' if kind is str else 'an integer'}")
        if kind is str and not value.strip():
            raise self.err(node, f"{what} must not be empty")
        return value

    def expr(self, node, what) -> Expr:
        src = self.scalar(node, what, str)
        try:
            fn = self.env.compile_expression(src, undefined_to_none=False)
        except jinja2.TemplateSyntaxError as e:
            raise self.err(node, f"{what}: bad expression {src!r}: {e.message}") from None
        return Expr(src, self.where(node), fn)

    def inline(self, node, what) -> Snippet:
        src = self.scalar(node, what, str)
        try:
            return Snippet(self.env.from_string(src), self.where(node))
        except jinja2.TemplateSyntaxError as e:
            raise self.err(node, f"{what}: bad template {src!r}: {e.message}") from None

    def template_file(self, node, what) -> Snippet:
        name = self.scalar(node, what, str)
        try:
            t = self.env.get_template(name)
        except jinja2.TemplateNotFound:
            raise self.err(node, f"{what}: no template {name!r} next to the playbook") from None
        except jinja2.TemplateSyntaxError as e:
            raise ParseError(f"{e.filename}:{e.lineno}: {e.message}") from None
        return Snippet(t, self.where(node))


def _environment(directory: str) -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        loader=jinja2.FileSystemLoader(directory), undefined=jinja2.StrictUndefined,
        autoescape=False, keep_trailing_newline=False)
    env.tests["identifier"] = lambda v: isinstance(v, str) and v.isidentifier()
    env.filters["quote"] = shlex.quote  # for values templated into handler or smoke commands
    return env


def load_playbook(path: str | os.PathLike) -> Playbook:
    """Load and check a playbook YAML file (schema in the module docstring).

    Templates are resolved relative to the playbook's directory and syntax-checked now.
    Raises ParseError "file:line: what" (exit 4) for bad YAML, unknown or missing keys, wrong
    types, bad Jinja2 syntax, missing templates and notify names without a handler.
    """
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ParseError(f"{path}: cannot read playbook: {e.strerror}") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise ParseError(f"{path}{line}: bad YAML: {getattr(e, 'problem', None) or e}") from None
    if root is None:
        raise ParseError(f"{path}:1: empty playbook")
    env = _environment(os.path.dirname(os.path.abspath(path)))
    r = _Reader(path, env)
    top = r.mapping(root, "playbook", required=("name", "tasks"),
                    optional=("description", "requires", "handlers", "validate", "on_failure"))

    requires = []
    for n in r.seq(top["requires"], "requires") if "requires" in top else []:
        m = r.mapping(n, "requirement", required=("that", "reason"))
        requires.append(Requirement(r.expr(m["that"], "that"), r.scalar(m["reason"], "reason", str)))

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
        m = r.mapping(n, "task", required=("name", "edit_expressions"), optional=("notify",))
        e = r.mapping(m["edit_expressions"], "edit_expressions",
                      required=("findings", "when", "value", "comment", "marker"))
        notify = []
        for h in r.seq(m["notify"], "notify") if "notify" in m else []:
            hname = r.scalar(h, "notify entry", str)
            if hname not in handlers:
                raise r.err(h, f"notify names no handler: {hname!r}")
            notify.append(hname)
        tasks.append(EditTask(
            r.scalar(m["name"], "task name", str), r.scalar(e["findings"], "findings", str),
            r.expr(e["when"], "when"), r.template_file(e["value"], "value"),
            r.template_file(e["comment"], "comment"), r.scalar(e["marker"], "marker", str), notify))
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
            opts = r.mapping(body, step, optional={"reinspect": ("when", "that"),
                                                   "smoke": ("when", "offline")}.get(step, ("when",)))
        if step not in VALIDATE_STEPS:
            raise r.err(n, f"unknown validate step {step!r} (known: {', '.join(VALIDATE_STEPS)})")
        validate.append(ValidateStep(step, r.expr(opts["when"], "when") if "when" in opts else None,
                                     r.expr(opts["that"], "that") if "that" in opts else None,
                                     r.inline(opts["offline"], "offline") if "offline" in opts else None))

    on_failure = r.scalar(top["on_failure"], "on_failure", str) if "on_failure" in top else "rollback"
    if on_failure not in ON_FAILURE:
        raise r.err(top["on_failure"], f"on_failure must be one of {', '.join(ON_FAILURE)}")
    return Playbook(r.scalar(top["name"], "name", str),
                    r.scalar(top["description"], "description", str) if "description" in top else "",
                    path, requires, tasks, handlers, validate, on_failure, env)
