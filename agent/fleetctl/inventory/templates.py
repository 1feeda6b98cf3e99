"""Templated inventory vars: the vars fleetctl reads, rendered as Ansible renders them, safely.

Only the vars fleetctl reads (`needed`) are rendered, and the vars they reference are rendered
only when referenced (`_RenderedVars` is a lazy mapping): real group_vars hold lookups and
facts that fleetctl never reads, and they must not stop a load. Templates render in Jinja2's
ImmutableSandboxedEnvironment with Jinja2's own filters plus the Ansible ones inventories use for
connection values (`bool`, `quote`, `regex_replace`; ansible/plugins/filter/core.py), and with
Ansible's magic variables `inventory_hostname`, `inventory_hostname_short`, `groups`,
`group_names` and `hostvars` (ansible/vars/manager.py, _get_magic_variables) and the host vars
`inventory_dir` and `inventory_file` (ansible/inventory/data.py, add_host). `!unsafe` values
(`Unsafe`) are never rendered, as in Ansible. A lookup, an unknown filter, an undefined variable
or a sandbox violation in a needed var is an InventoryError (exit 4) naming the file and line the
value came from.

The Templar also knows which rendered values came from vault values (Templar.from_vault): a
`!vault` value, a value set in a file vault-encrypted whole (InEncryptedFile), or a var whose
rendering read one of those. `inventory export` asks it (through `templars()`), so that it writes
no decrypted value.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import shlex
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from .. import config
from ..errors import InventoryError

# Names of the vars fleetctl reads (every connection kind's among them); everything else is left
# as the inventory wrote it.
_NEEDED = ("ansible_connection", "ansible_python_interpreter", *(n for v in config.CONNECTION_VARS for n in v.names))
_NEEDED_PREFIXES = ("ansible_ssh_", "ansible_become", "fleetctl_")
_MARKERS = ("{{", "{%", "{#")
_HINT = ("fleetctl renders plain Jinja2 with only Ansible's default/d, bool, int, quote and "
         "regex_replace filters: put the rendered value in the inventory (`ansible -i INVENTORY HOST "
         "-m debug -a var=NAME` shows it; `ansible-inventory -i INVENTORY --list` the inventory as "
         "Ansible reads it)")


class Unsafe(str):
    """An `!unsafe` value (Ansible's AnsibleUnsafeText): used as written, never templated."""


class Vaulted(str):
    """The ciphertext of an Ansible Vault value (`!vault |`); decrypted only with a vault secret."""


class InEncryptedFile(str):
    """A "file:line" in a file vault-encrypted whole (`ansible-vault encrypt`): the value set there
    is decrypted text, as secret as a `!vault` one, though nothing marks the value itself."""


# The Templars of the loads made inside `templars()`.
_TEMPLARS: contextvars.ContextVar[list | None] = contextvars.ContextVar("fleetctl_templars", default=None)


@contextlib.contextmanager
def templars() -> Iterator[list[Templar]]:
    """A list that gets the Templar of every inventory loaded inside the block (model.build makes
    one per load), in load order: what `inventory export` asks which vars came from vault values
    (Templar.from_vault) and what the inventory wrote (Templar.raw, Templar.where)."""
    made: list[Templar] = []
    token = _TEMPLARS.set(made)
    try:
        yield made
    finally:
        _TEMPLARS.reset(token)


def needed(name: str) -> bool:
    """Whether fleetctl reads the inventory var `name` (so it is templated and checked at load)."""
    return name in _NEEDED or name.startswith(_NEEDED_PREFIXES)


def is_template(value: Any) -> bool:
    """Whether `value` is a string Ansible would template (not `!unsafe`, holds a Jinja2 marker)."""
    return isinstance(value, str) and not isinstance(value, (Unsafe, Vaulted)) and \
        any(m in value for m in _MARKERS)


class _NotRun(Exception):
    """A template called something fleetctl never runs (a lookup)."""


def _lookup(kind: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise _NotRun(f"{kind}({', '.join(map(repr, args))}) is an Ansible lookup, which fleetctl does not run")
    return refuse


def as_bool(value: Any) -> bool:
    """Ansible's `bool` filter (ansible/module_utils/parsing/convert_bool.py, boolean(strict=False))."""
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in ("yes", "on", "1", "true", "t", "y", "1.0")


def _regex_replace(value: Any, pattern: str = "", replacement: str = "",
                   ignorecase: bool = False, multiline: bool = False, count: int = 0) -> str:
    """Ansible's `regex_replace` filter (ansible/plugins/filter/core.py): re.sub on str(value)."""
    flags = (re.I if ignorecase else 0) | (re.M if multiline else 0)
    return re.sub(pattern, replacement, str(value), count=count, flags=flags)


@lru_cache(maxsize=None)
def _environment() -> Any:
    """The sandbox, rendering as ansible-core 2.19 does: a template that is one `{{ expr }}` gives
    the expression's own value (a number, a list, a bool), anything else its text. (Jinja2's
    native code generator folds an expression of constants alone to its text: `{{ 22 }}` is "22".)
    Undefined as in Ansible: `a.b | default(x)` works; using an undefined value is an error.
    Jinja2 is imported here, the first time an inventory holds a template (0.1 s of every
    command's start otherwise)."""
    import jinja2
    import jinja2.sandbox
    from jinja2.nativetypes import NativeCodeGenerator

    class Undefined(jinja2.ChainableUndefined, jinja2.StrictUndefined):
        pass

    class Environment(jinja2.sandbox.ImmutableSandboxedEnvironment):
        code_generator_class = NativeCodeGenerator

        @staticmethod
        def concat(parts: Iterable[Any]) -> Any:
            parts = list(parts)
            if len(parts) == 1:
                return str(parts[0]) if isinstance(parts[0], jinja2.Undefined) else parts[0]  # str(): the error
            return "".join(map(str, parts))

    env = Environment(undefined=Undefined, autoescape=False)
    env.filters.update(bool=as_bool, quote=shlex.quote, regex_replace=_regex_replace)
    env.globals.update(lookup=_lookup("lookup"), query=_lookup("query"), q=_lookup("q"))
    return env


class Templar:
    """Renders needed vars of every host of one inventory, lazily and once each.

    `raw`: host -> merged vars as the inventory wrote them; `where`: host -> var -> "file:line"
    the value came from; `groups`: group -> hosts (transitively), `all` first; `decrypt`: turns a
    Vaulted into its plain text (raises InventoryError when no vault secret was given); `source`:
    the inventory file or directory (for `inventory_dir` and `inventory_file`).
    `vaulted` holds the (host, var) rendered from a vault value (see from_vault).
    """

    def __init__(self, raw: Mapping[str, Mapping[str, Any]], where: Mapping[str, Mapping[str, str]],
                 groups: Mapping[str, tuple[str, ...]], decrypt: Callable[[Vaulted, str, str], str],
                 source: Path):
        self.raw, self.where, self.decrypt = raw, where, decrypt
        source = source.absolute()
        # Ansible sets these on each host from the file that defined it; a directory source's
        # files are not known here, so only its directory is.
        self.source = {"inventory_dir": str(source if source.is_dir() else source.parent)}
        if not source.is_dir():
            self.source["inventory_file"] = str(source)
        self.groups = {g: list(hosts) for g, hosts in groups.items()}
        self.done: dict[tuple[str, str], Any] = {}
        self.active: list[tuple[str, str]] = []
        self.vaulted: set[tuple[str, str]] = set()
        self.groups.setdefault("ungrouped", [])  # Ansible always has it
        self.hostvars = {h: _hostvars(self, h) for h in raw}
        if _TEMPLARS.get() is not None:
            _TEMPLARS.get().append(self)

    def from_vault(self, host: str, name: str) -> bool:
        """Whether the value of `name` for `host` is, or was rendered from, a vault secret: the var
        is set in a file vault-encrypted whole (InEncryptedFile), or its rendering (value) decrypted
        a `!vault` value or read a var that is from_vault, through any chain of templates.
        Raises KeyError when the host has no such var."""
        return (host, name) in self.vaulted or isinstance(self.where[host][name], InEncryptedFile)

    def value(self, host: str, name: str) -> Any:
        """The rendered value of `name` for `host`: a template its value (see _environment;
        checked and converted by the caller), a vault value its plain text, anything else as it is.
        Raises KeyError when the host has no such var, InventoryError when it cannot be rendered."""
        key = (host, name)
        if key in self.done:
            if key in self.vaulted:
                self.vaulted.update(self.active)  # every var being rendered read it
            return self.done[key]
        raw = self.raw[host][name]
        where = self.where[host][name]
        if key in self.active:
            loop = " -> ".join(n for _, n in self.active[self.active.index(key):] + [key])
            raise InventoryError(f"{where}: {name} refers to itself: {loop}")
        self.active.append(key)
        if isinstance(where, InEncryptedFile):
            self.vaulted.update(self.active)
        try:
            self.done[key] = self._render(host, name, raw, where)
        finally:
            self.active.pop()
        return self.done[key]

    def _render(self, host: str, name: str, value: Any, where: str) -> Any:
        if isinstance(value, Vaulted):
            self.vaulted.update(self.active)
            return self.decrypt(value, name, where)
        if isinstance(value, dict):
            return {k: self._render(host, name, v, where) for k, v in value.items()}
        if isinstance(value, list):
            return [self._render(host, name, v, where) for v in value]
        if not is_template(value):
            return value
        import jinja2  # loaded by _environment()
        try:
            template = _environment().from_string(value)
            context = template.new_context(_context(self, host), shared=True)
            text = template.environment.concat(template.root_render_func(context))
        except InventoryError:
            raise
        except _NotRun as e:
            raise InventoryError(f"{where}: {name}: {e}; {_HINT}") from None
        except jinja2.TemplateError as e:
            raise InventoryError(f"{where}: {name}: cannot render {value!r}: {str(e.message or e).rstrip('.')}; {_HINT}") from None
        return text


class _Layers(Mapping[str, Any]):
    """Mappings looked up in order, the first that has a name winning (read lazily)."""

    def __init__(self, *layers: Mapping[str, Any]):
        self.layers = layers

    def __getitem__(self, name: str) -> Any:
        for layer in self.layers:
            if name in layer:
                return layer[name]
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(n for layer in self.layers for n in layer))

    def __len__(self) -> int:
        return len(set().union(*self.layers))


class _RenderedVars(Mapping[str, Any]):
    """One host's inventory vars, each rendered when first read."""

    def __init__(self, templar: Templar, host: str):
        self.templar, self.host = templar, host

    def __getitem__(self, name: str) -> Any:
        if name not in self.templar.raw[self.host]:
            raise KeyError(name)
        return self.templar.value(self.host, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.templar.raw[self.host])

    def __len__(self) -> int:
        return len(self.templar.raw[self.host])


def _host_magic(templar: Templar, host: str) -> dict[str, Any]:
    """The magic variables Ansible sets for `host` (its hostvars[host] has them too)."""
    member_of = sorted(g for g, hosts in templar.groups.items() if host in hosts and g not in ("all", "ungrouped"))
    return {"inventory_hostname": host, "inventory_hostname_short": host.split(".")[0],
            "group_names": member_of, **templar.source}


def _hostvars(templar: Templar, host: str) -> _Layers:
    """hostvars[host]: the host's magic variables over its vars, as in Ansible."""
    return _Layers(_host_magic(templar, host), _RenderedVars(templar, host))


def _context(templar: Templar, host: str) -> _Layers:
    """What a template of `host` sees: the magic variables (groups and hostvars among them), the
    host's vars (lazily), the environment's globals."""
    return _Layers({"groups": templar.groups, "hostvars": templar.hostvars}, templar.hostvars[host],
                   _environment().globals)
