"""Reading a playbook: its files, safely, and its YAML nodes as checked values, each error naming
the file and line (ParseError, exit 4). What a playbook says is engine/playbooks/model.py's; this module
knows how any of it is read.

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
`fleetctl:probes/buildtrust.py`, the trust walk its finding runs).
"""

from __future__ import annotations

import errno
import os
import re
import shlex
import stat
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.sandbox
import yaml

from ... import probes
from ...errors import ParseError

# The template names of fleetctl's own probe modules: SHIPPED + "buildtrust.py", + "facts/host.py".
SHIPPED = "fleetctl:probes/"
_PROBE_FILE = re.compile(r"(?:[a-z_][a-z0-9_]*/)?[a-z_][a-z0-9_]*\.py")


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


def read_inside(directory: str, name: str, what: str = "template") -> tuple[str, str]:
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
    """Jinja2's loader for a playbook's templates: read_inside(directory, name), or _shipped(name)
    for a name starting with SHIPPED. Templates are read once (never reloaded from a changed file)."""

    def __init__(self, directory: str):
        self.directory = directory

    def get_source(self, environment: jinja2.Environment, template: str) -> tuple[str, str, None]:
        text, path = _shipped(template) if template.startswith(SHIPPED) else read_inside(self.directory, template)
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


class Reader:
    """Turns yaml nodes into checked values; every error names file:line."""

    def __init__(self, path: str, env: jinja2.Environment):
        self.path, self.env = path, env
        self.construct = yaml.constructor.SafeConstructor()

    def where(self, node: yaml.Node) -> str:
        """"file:line" of `node`."""
        return f"{self.path}:{node.start_mark.line + 1}"

    def err(self, node: yaml.Node, msg: str) -> ParseError:
        """ParseError "file:line: msg" at `node` (to raise)."""
        return ParseError(f"{self.where(node)}: {msg}")

    def mapping(self, node, what, required=(), optional=()) -> dict[str, yaml.Node]:
        """{key: value node} of mapping `node` (`what` it is, for messages), its keys all in
        `required` or `optional` (in the order given: the messages list them so), each once,
        every required one there."""
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
        """The item nodes of list `node`."""
        if not isinstance(node, yaml.SequenceNode):
            raise self.err(node, f"{what} must be a list")
        return node.value

    def scalar(self, node, what, kind):
        """The value of scalar `node`, of type `kind` (str: not blank; int: not a bool)."""
        value = self.construct.construct_object(node, deep=True) if isinstance(node, yaml.ScalarNode) else node
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.err(node, f"{what} must be {'a string' if kind is str else 'an integer'}")
        if kind is str and not value.strip():
            raise self.err(node, f"{what} must not be empty")
        return value

    def expr(self, node, what) -> Expr:
        """The Jinja2 expression `node` holds, compiled."""
        src = self.scalar(node, what, str)
        try:
            fn = self.env.compile_expression(src, undefined_to_none=False)
        except jinja2.TemplateSyntaxError as e:
            raise self.err(node, f"{what}: bad expression {src!r}: {e.message}") from None
        return Expr(src, self.where(node), fn)

    def inline(self, node, what) -> Snippet:
        """The inline Jinja2 template `node` holds, compiled."""
        src = self.scalar(node, what, str)
        try:
            return Snippet(self.env.from_string(src), self.where(node))
        except jinja2.TemplateSyntaxError as e:
            raise self.err(node, f"{what}: bad template {src!r}: {e.message}") from None

    def template_file(self, node, what) -> Snippet:
        """The template file `node` names (relative to the playbook; read by PlaybookLoader),
        compiled."""
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


def environment(directory: str) -> jinja2.Environment:
    """The Jinja2 environment of the playbook in `directory`: sandboxed, StrictUndefined, its
    templates read by PlaybookLoader; plus the `identifier` test and the `quote` filter."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        loader=PlaybookLoader(directory), undefined=jinja2.StrictUndefined,
        autoescape=False, keep_trailing_newline=False)
    env.tests["identifier"] = lambda v: isinstance(v, str) and v.isidentifier()
    env.filters["quote"] = shlex.quote  # for values templated into handler or smoke commands
    return env
