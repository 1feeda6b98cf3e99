"""Playbooks: YAML files plus Jinja2 templates that say how to change a host, checked on load.

A playbook is data; `fleetctl.engine.plan` turns it and one host's facts and findings into a plan.
Schema (every key is checked; an error names the file and line, ParseError, exit 4):

    name: defrag-tier0                      # required
    description: ...                        # optional
    requires:                               # optional; the first false one skips the host
      - that: "facts.sglang is not none"    # Jinja2 expression over host vars, facts, findings
        reason: "sglang is not installed"   # a template -> status skipped, "not applicable: <reason>"
        refuse: true                        # optional: status failed with the reason instead
    tasks:                                  # required, at least one; each has one of
      - name: ...                           # edit_expressions, create_file, insert_text
        create_file:                        # a new file of the install, rendered (pre-image: absent;
          path: "{{ findings.x.file }}"     # rollback deletes it); one already there with the
          template: templates/x/new.py.j2   # rendered text is "already applied", any other refused
        insert_text:                        # text inserted before a line of an install's file:
          site: "findings.x.guard"          # an expression giving {file, line, present}: present is
          template: templates/x/guard.j2    # the text already there (== the rendered: applied; else
          marker: "fleetctl x"              # refused), rendered unstripped, holding the marker
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
      - load: {profile: pressure}           # the load gate: SGLang's own benchmark client before
                                            # and after (engine/load.py; settings: load.SETTINGS,
                                            # e.g. max_throughput_drop: 0.1, repeat: 2); at most one
      - route                               # the route gate (engine/routegate.py): every rank routed,
                                            # tokens and logprobs equal to the baseline's; no settings
                                            # but `when`; at most one, after a smoke step
    on_failure: rollback                    # rollback (default) | keep

Templates render in Jinja2's ImmutableSandboxedEnvironment with StrictUndefined: a playbook
from a colleague cannot run code on the control machine (no `__class__`/`__globals__` walks, no
calls that mutate); an undefined variable or a sandbox violation raises ParseError naming the
template file and line. The playbook file and every template, `{% include %}`, `{% import %}` and
`{% extends %}` included, are read by PlaybookLoader only: from regular files inside the
playbook's directory, reached without a symbolic link, in directories and files that belong to
the operator (euid) or root and that only their owner can write (review N8: a template linked to
/root/.ssh/id_ed25519 would otherwise go into handler commands, comments and diffs). One other
name reads fleetctl's own shipped text, never a file of the operator's: `fleetctl:probes/NAME.py`
is probe NAME's source as the bundler sends it to hosts (route-verify-attention's hook includes
`fleetctl:probes/buildtrust.py`, the trust walk its finding runs). Render context:
the host's inventory vars at top level, plus `host` (inventory name), `facts`, `findings`
and, in per-site templates, `finding` (one inspect finding plus `expr_one_line`).
"""

from __future__ import annotations

import errno
import os
import re
import shlex
import stat
from dataclasses import dataclass, field
from typing import Any

import jinja2
import jinja2.sandbox
import yaml

from .. import probes
from ..errors import ParseError
from .load import SETTINGS as LOAD_SETTINGS, load_options

# The template names of fleetctl's own probe modules: SHIPPED + "buildtrust.py", + "facts/host.py".
SHIPPED = "fleetctl:probes/"
_PROBE_FILE = re.compile(r"(?:[a-z_][a-z0-9_]*/)?[a-z_][a-z0-9_]*\.py")
VALIDATE_STEPS = ("compile", "reinspect", "smoke", "load", "route")
TASK_KINDS = ("edit_expressions", "create_file", "insert_text")
ON_FAILURE = ("rollback", "keep")


class TemplateRefused(Exception):
    """A playbook file or template that PlaybookLoader will not read; the message says which
    and why (not a TemplateNotFound, which `{% include ... ignore missing %}` would skip)."""


def _owned(st: os.stat_result, path: str, kind: str = "") -> None:
    """Raise TemplateRefused unless `st` (of `path`; `kind` names it in the message) belongs to
    the operator (euid) or root and only its owner can write it: what fleetctl renders and sends
    to hosts is then the text the operator read."""
    euid = os.geteuid()
    if st.st_uid not in (0, euid):
        raise TemplateRefused(f"{kind}{path} is owned by uid {st.st_uid}, not by you (uid {euid}) or root: its "
                              "owner could change the playbook after you read it; copy the playbook into a directory "
                              "of yours")
    if st.st_mode & 0o022:
        raise TemplateRefused(f"{kind}{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): "
                              f"they could change the playbook after you read it; chmod go-w {path}")


def _read_inside(directory: str, name: str, what: str = "template") -> tuple[str, str]:
    """(text, path) of `name` ("a/b.j2": "/"-separated, relative; `what` it is, for messages)
    read from inside `directory`. Each component is opened relative to the one before with
    O_NOFOLLOW, so no symbolic link is followed and nothing outside `directory` is reached;
    `directory`, each directory on the way and the file must pass _owned; the file must be a
    regular UTF-8 file; no component may start with "." (a playbook saved in a home directory
    must not reach .ssh/ or .git/). `directory` itself is opened as the operator named it. Raises
    jinja2.TemplateNotFound when nothing has that name, TemplateRefused (saying which component,
    and why) for anything else."""
    pieces = [p for p in name.split("/") if p not in ("", ".")]
    if not pieces or ".." in pieces:
        raise TemplateRefused(f"{what} {name!r} is not a path inside the playbook directory {directory}")
    hidden = [p for p in pieces if p.startswith(".")]
    if hidden:  # .ssh/, .git/config, .env, .vault_pass: a playbook saved in a home directory must not reach them
        raise TemplateRefused(f"{what} {name!r}: {hidden[0]} is a hidden name: fleetctl reads no dotfile or "
                              "dot-directory of the playbook's directory")
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise TemplateRefused(f"cannot open the playbook directory {directory}: {e.strerror}") from None
    where = directory
    try:
        _owned(os.fstat(fd), directory, "the playbook directory ")
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            where = os.path.join(where, piece)
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_NONBLOCK if last else os.O_DIRECTORY)
            try:
                nfd = os.open(piece, flags, dir_fd=fd)
            except OSError as e:
                if e.errno == errno.ENOENT:
                    raise jinja2.TemplateNotFound(name) from None
                if e.errno == errno.ELOOP or (e.errno == errno.ENOTDIR and stat.S_ISLNK(
                        os.stat(piece, dir_fd=fd, follow_symlinks=False).st_mode)):
                    raise TemplateRefused(
                        f"{what} {name!r}: {where} is a symbolic link (to {os.readlink(piece, dir_fd=fd)}): fleetctl "
                        "reads a playbook and its templates only from regular files inside the playbook's directory, "
                        "reached without links; copy the file in") from None
                raise TemplateRefused(f"{what} {name!r}: cannot open {where}: {e.strerror}") from None
            os.close(fd)
            fd = nfd
            st = os.fstat(fd)
            if last and not stat.S_ISREG(st.st_mode):
                raise TemplateRefused(f"{what} {name!r}: {where} is not a regular file")
            _owned(st, where)
        with os.fdopen(fd, "rb") as f:
            fd = -1
            data = f.read()
    finally:
        if fd >= 0:
            os.close(fd)
    try:
        return data.decode("utf-8"), where
    except UnicodeDecodeError as e:
        raise TemplateRefused(f"{what} {name!r}: {where} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _shipped(name: str) -> tuple[str, str]:
    """(text, path) of fleetctl's probe module that template name `name` (SHIPPED + "room/x.py")
    names: probes.source's text, the one the bundler sends to hosts. Raises TemplateRefused for
    a name of another form, jinja2.TemplateNotFound when fleetctl has no such probe."""
    rel = name[len(SHIPPED):]
    if not _PROBE_FILE.fullmatch(rel):
        raise TemplateRefused(f"template {name!r}: {SHIPPED}... names a probe module of fleetctl's, "
                              f"{SHIPPED}NAME.py or {SHIPPED}ROOM/NAME.py")
    try:
        text = probes.source(rel[:-3].replace("/", "."))
    except OSError:
        raise jinja2.TemplateNotFound(name) from None
    return text, os.path.join(os.path.dirname(probes.__file__), rel)


class PlaybookLoader(jinja2.BaseLoader):
    """Jinja2's loader for a playbook's templates: _read_inside(directory, name), or _shipped(name)
    for a name starting with SHIPPED. Templates are read once (never reloaded from a changed file)."""

    def __init__(self, directory: str):
        self.directory = directory

    def get_source(self, environment: jinja2.Environment, template: str) -> tuple[str, str, None]:
        text, path = _shipped(template) if template.startswith(SHIPPED) else _read_inside(self.directory, template)
        return text, path, None


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

    def render(self, ctx: dict[str, Any], strip: bool = True) -> str:
        """Render with `ctx`, stripped (unless not `strip`). Raises ParseError "file:line:
        message" on any template error."""
        try:
            text = self.template.render(ctx)
            return text.strip() if strip else text
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
    reason: Snippet
    refuse: bool = False


@dataclass
class CreateTask:
    """Create a file of the install (`path`, rendered) from `template`; see the module docstring."""

    name: str
    path: Snippet
    template: Snippet
    notify: list[str]


@dataclass
class InsertTask:
    """Insert `template`'s text (unstripped) before the line the `site` expression names."""

    name: str
    site: Expr
    template: Snippet
    marker: str
    notify: list[str]


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
    load: dict | None = None  # load only: its settings (engine/load.load_options), checked


@dataclass
class Playbook:
    """A loaded, checked playbook. `path` is the YAML file; `env` renders its templates."""

    name: str
    description: str
    path: str
    requires: list[Requirement]
    tasks: list[EditTask | CreateTask | InsertTask]
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
        except TemplateRefused as e:
            raise self.err(node, f"{what}: {e}") from None
        except jinja2.TemplateSyntaxError as e:
            raise ParseError(f"{e.filename}:{e.lineno}: {e.message}") from None
        return Snippet(t, self.where(node))


def _environment(directory: str) -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        loader=PlaybookLoader(directory), undefined=jinja2.StrictUndefined,
        autoescape=False, keep_trailing_newline=False)
    env.tests["identifier"] = lambda v: isinstance(v, str) and v.isidentifier()
    env.filters["quote"] = shlex.quote  # for values templated into handler or smoke commands
    return env


def load_playbook(path: str | os.PathLike) -> Playbook:
    """Load and check a playbook YAML file (schema in the module docstring).

    The file and its templates are read by PlaybookLoader's rules (the module docstring);
    templates are resolved relative to the playbook's directory and syntax-checked now.
    Raises ParseError "file:line: what" (exit 4) for bad YAML, unknown or missing keys, wrong
    types, bad Jinja2 syntax, missing or refused templates (a symlink, outside the directory, a
    directory or file another user owns or may write) and notify names without a handler; a
    template that `{% include %}`s a refused one raises ParseError "template:line: ..." when rendered.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        text, _ = _read_inside(directory, os.path.basename(path), "playbook")
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
    env = _environment(directory)
    r = _Reader(path, env)
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
        m = r.mapping(n, "task", required=("name",), optional=("notify",) + TASK_KINDS)
        kinds = [k for k in TASK_KINDS if k in m]
        if len(kinds) != 1:
            raise r.err(n, f"a task has one of {', '.join(TASK_KINDS)}")
        notify = []
        for h in r.seq(m["notify"], "notify") if "notify" in m else []:
            hname = r.scalar(h, "notify entry", str)
            if hname not in handlers:
                raise r.err(h, f"notify names no handler: {hname!r}")
            notify.append(hname)
        name = r.scalar(m["name"], "task name", str)
        if kinds[0] == "create_file":
            c = r.mapping(m["create_file"], "create_file", required=("path", "template"))
            tasks.append(CreateTask(name, r.inline(c["path"], "path"), r.template_file(c["template"], "template"),
                                    notify))
            continue
        if kinds[0] == "insert_text":
            c = r.mapping(m["insert_text"], "insert_text", required=("site", "template", "marker"))
            tasks.append(InsertTask(name, r.expr(c["site"], "site"), r.template_file(c["template"], "template"),
                                    r.scalar(c["marker"], "marker", str), notify))
            continue
        e = r.mapping(m["edit_expressions"], "edit_expressions",
                      required=("findings", "when", "value", "comment", "marker"))
        tasks.append(EditTask(
            name, r.scalar(e["findings"], "findings", str),
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
