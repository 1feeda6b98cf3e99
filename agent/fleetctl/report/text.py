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

from rich.cells import cell_len
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


def server_rows(r: Any, cells: Callable[[dict], list], columns: int, error_at: int) -> list[list[Text]]:
    """The rows of one host's result `r` (an engine.context.HostResult) in a table of servers: per
    server in r.data["servers"], the host, its status and the `columns` cells of cells(server)
    (tolerant of a malformed server); a host without servers gets one row, its error in cell
    `error_at` of the `columns`."""
    def status() -> Text:
        return text(r.status, style=STATUS_STYLE.get(r.status))
    servers = (r.data or {}).get("servers") or []
    if not servers:
        blank = [""] * columns
        blank[error_at] = r.error or ""
        return [[text(r.host), status(), *map(text, blank)]]
    return [[text(r.host), status(), *map(text, tolerant(lambda s=s: cells(s), columns))] for s in servers]


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
    """Print a simple table (one row per item; cells stringified; `style_of(column, value)` a
    cell's style): grid's layout."""
    grid(title, columns, [[text(v, style=style_of(c, v) if style_of else None) for c, v in zip(columns, row)]
                          for row in rows], console)


# what a table's frame takes: a border left of each column and one at the end, a space either side
# of each cell (Rich's default box and padding (0, 1))
def _frame(columns: int) -> int:
    return 3 * columns + 1


def _span(cells: list[Text]) -> tuple[int, int]:
    """(longest word, longest line) of a column's cells, in terminal cells: the narrowest width
    that breaks no word and the width that breaks no line."""
    words = [cell_len(w) for c in cells for w in c.plain.split()]
    lines = [cell_len(ln) for c in cells for ln in c.plain.split("\n")]
    return max(words, default=1), max(lines, default=1)


def fit(spans: list[tuple[int, int]], room: int) -> list[int] | None:
    """Column widths that fill at most `room` cells: each column its longest line where they all
    fit, else the widest columns narrowed first (as Rich does), none below its longest word; None
    when even the longest words do not fit side by side."""
    if sum(lo for lo, _ in spans) > room:
        return None
    widths = [hi for _, hi in spans]
    excess = sum(widths) - room
    while excess > 0:
        i = max((i for i, (lo, _) in enumerate(spans) if widths[i] > lo), key=lambda i: widths[i])
        widths[i] -= 1
        excess -= 1
    return widths


def _height(heads: list[Text], rows: list[list[Text]], widths: list[int], console: Console, show_lines: bool) -> int:
    """Lines a table of these rows takes at these column widths: its frame, header and rows."""
    def tall(cells: list[Text]) -> int:
        return max((len(c.wrap(console, w)) for c, w in zip(cells, widths)), default=1)
    return 3 + tall(heads) + sum(map(tall, rows)) + (max(len(rows) - 1, 0) if show_lines else 0)


def _blocks_height(columns: list[str], rows: list[list[Text]], width: int) -> int:
    """Lines the block layout of these rows takes at `width` columns: a line per row, and per
    non-empty value its lines as wrapped (one more for a value of several lines)."""
    def tall(column: str, cell: Text) -> int:
        lines = cell.plain.split("\n")
        head = len(column) + 4 if len(lines) == 1 else 4
        return sum(-(-max(head + cell_len(ln), 1) // max(width, 1)) for ln in lines) + (len(lines) > 1)
    return sum(1 + sum(tall(c, v) for c, v in zip(columns[1:], r[1:]) if v.plain.strip()) for r in rows)


def grid(title: Any, columns: list[str], rows: list[list[Text]], console: Console, show_lines: bool = False,
         column_style: dict[str, str] | None = None) -> None:
    """Print rows (cells: Text) under `columns` so that no word is cut: a table whose every
    column is at least as wide as its longest word (host names, change and run ids, paths hold
    no space, so each stays on one line and copies whole), when those fit the console's width
    side by side and the table takes no more lines than blocks would; else one block per row:
    its first cell on a line of its own, then "  column: value" for each other non-empty cell
    (the console wraps long values between words; a line with a word wider than the console is
    left to the terminal: _wider). `column_style`: a style per column name (in blocks, the
    value's)."""
    styles = column_style or {}
    heads = [Text(c) for c in columns]
    spans = [_span([h] + [r[i] for r in rows if i < len(r)]) for i, h in enumerate(heads)]
    widths = fit(spans, console.width - _frame(len(columns)))
    blocks = _blocks_height(columns, rows, console.width)
    if widths is not None and _height(heads, rows, widths, console, show_lines) <= blocks:
        t = Table(title=text(title), title_justify="left", show_lines=show_lines)
        for c, w in zip(columns, widths):
            t.add_column(c, width=w, style=styles.get(c), overflow="fold")
        for r in rows:
            t.add_row(*r)
        console.print(t)
        return
    console.print(text(title, style="italic"), highlight=False)
    for r in rows:
        console.print(Text.assemble(r[0] if r else "", style="bold"), highlight=False)
        for c, cell in zip(columns[1:], r[1:]):
            if not cell.plain.strip():
                continue
            value = cell.copy()
            if styles.get(c):
                value.stylize(styles[c])
            lines = value.split("\n")
            head = Text(f"  {c}: ", style="dim")
            if len(lines) == 1:
                console.print(head + value, highlight=False, soft_wrap=_wider(value, console))
                continue
            console.print(head, highlight=False)
            for ln in lines:
                console.print(Text("    ") + ln, highlight=False, soft_wrap=_wider(ln, console))


def _wider(value: Text, console: Console) -> bool:
    """Whether a word of `value` is wider than the console, indented: such a line is left for the
    terminal to wrap (a soft wrap, which a terminal's copy joins again), never cut in two by Rich."""
    return any(cell_len(w) > console.width - 4 for w in value.plain.split())
