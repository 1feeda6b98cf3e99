"""Safe text for the terminal and the HTML report: host strings as Rich Text, never markup.

Every string a host or an inventory supplies reaches Rich through `text()`: never parsed as
markup, control characters shown as escapes (security review M5). A host's data of an odd shape
becomes a "malformed" cell, never a crash that loses the report. Hosts whose findings are
identical are gathered by `coalesce` into one block with their host list (as clubak gathers
identical output).
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Iterable

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..vocab import HostStatus

# C0 controls but tab and newline, DEL, C1 controls, and the Unicode bidi and zero-width format
# characters that reorder or hide text on a terminal, and lone surrogates (no UTF-8 encodes them).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def visible(value: Any) -> str:
    """`value` as a string (None: "") with each control character shown as \\xNN / \\uNNNN, and each
    lone surrogate (an undecodable byte of a file name, as os.fsdecode gives it) as \\udcNN."""
    s = "" if value is None else str(value)
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", s)


def text(value: Any, style: str | None = None) -> Text:
    """A table cell or message built from host or inventory data: plain text (no markup), control
    characters visible (see visible)."""
    return Text(visible(value), style=style)


def tolerant(build: Callable[[], Any], columns: int) -> Any:
    """build(), or, when the host's data has an odd shape, `columns` cells: the first says so."""
    try:
        return build()
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as e:
        return ["malformed data from the host: " + visible(f"{type(e).__name__}: {e}")] + [""] * (columns - 1)


def gate_status(gate: dict) -> str:
    """A gate's status as shown (its result entry: engine/gates): the status word, and a skipped
    gate's reason in brackets ("skipped (no server)"); "" when there is none."""
    status = str(gate.get("status") or "")
    return f"{status} ({gate['reason']})" if gate.get("reason") else status


STATUS_STYLE = {HostStatus.OK: "green", HostStatus.CHANGED: "yellow", HostStatus.SKIPPED: "cyan",
                HostStatus.FAILED: "red", HostStatus.UNREACHABLE: "magenta", HostStatus.NOT_ATTEMPTED: "dim"}


def coalesce(items: Iterable[tuple[str, Any]]) -> list[tuple[list[str], Any]]:
    """Group (host, value) pairs with equal values: [([hosts], value)], first-seen order."""
    groups: dict[str, tuple[list[str], Any]] = {}
    for host, value in items:
        key = json.dumps(value, sort_keys=True, default=str)
        groups.setdefault(key, ([], value))[0].append(host)
    return list(groups.values())


def host_list(hosts: list[str], limit: int = 6) -> str:
    """'a, b, c' or 'a, b, c … (+N more: 12 hosts)'; the count is always given when shortened."""
    if len(hosts) <= limit:
        return ", ".join(hosts)
    return f"{', '.join(hosts[:limit])} … (+{len(hosts) - limit} more; {len(hosts)} hosts)"


def table(title: str, columns: list[str], rows: list[list[Any]], console: Console,
          style_of: Callable[[str, Any], str | None] | None = None) -> None:
    """Print a simple table (one row per item; cells stringified)."""
    t = Table(title=text(title), title_justify="left")
    for c in columns:
        t.add_column(c, overflow="fold")
    for row in rows:
        t.add_row(*[text(v, style=style_of(c, v) if style_of else None) for c, v in zip(columns, row)])
    console.print(t)
