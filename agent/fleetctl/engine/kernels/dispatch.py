"""The dispatch table of a kernel build: which shapes the hook routes to it (pure: no host touched).

The table lives beside the active link, `PUBLIC/NAME/dispatch.json` (config.PUBLIC_KERNELS_DIR),
written by `fleetctl deploy kernel` as one change with the `current` link (engine/kernels/deploy.py), read
by the hook (playbooks/templates/route-verify-attention/fleetctl_verify.py), the finding
(probes/facts/verifyroute.py) and `fleetctl status` (describe). Its shape (docs: issue 34's design,
section 2):

    {"schema": SCHEMA, "kernel": NAME, "build": KEY, "backend": "cpu" | "cuda" | "triton",
     "source": "operator" | "measured" | "none",
     "route": "all" | ["64:2:4:float32:8", ...] | None,    # the operator's --route, as given
     "all": bool,                                          # every shape the build serves routes
     "entries": [{"head_dim", "group", "draft_tokens", "dtype", "max_batch": int | None,
                  "speedup": [float, ...] | None}],        # measured: per prefix, measured.prefixes' order
     "measured": None | {"prefixes", "min_speedup", "shapes", "device"},
     "why": one line, "made": "YYYY-MM-DDTHH:MM:SSZ" (UTC)}

A call routes only when the table's build is the key `current` names and `all` is true or an
entry matches (head_dim, group, draft_tokens, dtype) with batch <= max_batch (None: any): the
hook's rule, read by probes/buildtrust.py's `table` (the hook and the finding run that one text).
"""

from __future__ import annotations

import json
import time

SCHEMA = "fleetctl-dispatch/1"
FILE = "dispatch.json"
DTYPES = ("float16", "bfloat16", "float32")
SOURCES = ("operator", "measured", "none")
NO_GPU = "no GPU to measure on: nothing routes unless --route all or --route SHAPES"
SHAPE_FORM = "HEAD_DIM:GROUP:DRAFT_TOKENS:DTYPE[:MAX_BATCH]"


class RouteError(ValueError):
    """A route value parse_route refuses. Its text says why, without the option's name (the
    caller names it: "--route" on the command line, "route" in the collection's kernel task);
    `spec`: the shape spec (or "all") the text begins with, None when it is about the value as a
    whole."""

    def __init__(self, why: str, spec: str | None = None):
        super().__init__(why)
        self.spec = spec


def now() -> str:
    """The current UTC time as the table's "made" ("2026-12-02T10:00:00Z")."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def parse_route(specs: list[str] | None) -> str | list[str] | None:
    """The operator's `--route` values (repeatable, each comma-separated) as the table's "route":
    None (none given), "all", or the shape specs in the order given, each SHAPE_FORM (spaces
    around commas dropped). Raises RouteError for a spec that is not a shape (parse_shape), "all"
    beside shapes, an empty spec, or the same (head_dim, group, draft_tokens, dtype) twice."""
    if not specs:
        return None
    parts = [p.strip() for s in specs for p in s.split(",")]
    if any(not p for p in parts):
        raise RouteError(f"an empty shape in {', '.join(map(repr, specs))}")
    if "all" in parts:
        if set(parts) != {"all"}:
            raise RouteError("all routes every shape: it cannot be given with shapes", "all")
        return "all"
    seen: dict[tuple, str] = {}
    for p in parts:
        e = parse_shape(p)
        k = shape_key(e)
        if k in seen:
            raise RouteError(f"{p}: the shape {seen[k]} is given already", p)
        seen[k] = p
    return parts


def parse_shape(spec: str) -> dict:
    """One SHAPE_FORM spec ("64:2:4:float32" or "64:2:4:float32:8") as a table entry
    {"head_dim", "group", "draft_tokens", "dtype", "max_batch" (None: any batch), "speedup": None}.
    head_dim, group (query heads per KV head), draft_tokens and max_batch are positive integers;
    dtype one of DTYPES. Raises RouteError naming what is wrong."""
    fields = spec.split(":")
    if len(fields) not in (4, 5):
        raise RouteError(f"{spec!r}: expected all or {SHAPE_FORM}", spec)
    names = ("head_dim", "group", "draft_tokens")
    nums = {}
    for name, v in zip(names + ("max_batch",), fields[:3] + fields[4:]):
        if not v.isdigit() or int(v) < 1:
            raise RouteError(f"{spec!r}: {name} must be a positive integer, not {v!r}", spec)
        nums[name] = int(v)
    if fields[3] not in DTYPES:
        raise RouteError(f"{spec!r}: dtype must be one of {', '.join(DTYPES)}, not {fields[3]!r}", spec)
    return {"head_dim": nums["head_dim"], "group": nums["group"], "draft_tokens": nums["draft_tokens"],
            "dtype": fields[3], "max_batch": nums.get("max_batch"), "speedup": None}


def shape_key(entry: dict) -> tuple:
    """(head_dim, group, draft_tokens, dtype) of a table entry: what a call is matched on."""
    return (entry["head_dim"], entry["group"], entry["draft_tokens"], entry["dtype"])


def _table(kernel: str, build: str, backend: str, source: str, route, all_: bool, entries: list, measured,
           why: str, made: str | None) -> dict:
    return {"schema": SCHEMA, "kernel": kernel, "build": build, "backend": backend, "source": source,
            "route": route, "all": all_, "entries": list(entries), "measured": measured,
            "why": " ".join(str(why).split())[:800], "made": made or now()}  # why: one line


def operator_table(kernel: str, build: str, backend: str, route: str | list[str], made: str | None = None) -> dict:
    """The table of the operator's `--route` (parse_route's "all" or shape list): source
    "operator", all true for "all", else one entry per shape (speedup None)."""
    if route == "all":
        return _table(kernel, build, backend, "operator", "all", True, [], None, "operator: --route all", made)
    entries = [parse_shape(s) for s in route]
    return _table(kernel, build, backend, "operator", list(route), False, entries, None,
                  "operator: --route " + ",".join(route), made)


def none_table(kernel: str, build: str, backend: str, why: str = NO_GPU, made: str | None = None) -> dict:
    """The table that routes nothing: source "none", no entries, `why` (default NO_GPU)."""
    return _table(kernel, build, backend, "none", None, False, [], None, why, made)


def measured_table(kernel: str, build: str, backend: str, entries: list, measured: dict, why: str,
                   made: str | None = None) -> dict:
    """The table engine/kernels/measure.py measured: source "measured", the `entries` it enabled (each
    with its per-prefix "speedup"), `measured` ({prefixes, min_speedup, shapes, device, sglang})."""
    return _table(kernel, build, backend, "measured", None, False, entries, measured, why, made)


def text(table: dict) -> str:
    """The table's canonical file text: JSON with sorted keys, one-space indent, a final newline
    (the same table always gives the same bytes; the change engine hashes them)."""
    return json.dumps(table, indent=1, sort_keys=True) + "\n"


def _routing(table: dict) -> dict:
    """What decides a table's routing, for same_routing: everything but when it was made, its
    why, its measurement notes and the entries' measured speedups."""
    out = {k: v for k, v in table.items() if k not in ("made", "why", "measured", "entries")}
    out["entries"] = sorted(({k: v for k, v in e.items() if k != "speedup"} for e in table.get("entries") or []),
                            key=lambda e: json.dumps(e, sort_keys=True))
    return out


def same_routing(a: dict | None, b: dict | None) -> bool:
    """Whether tables `a` and `b` route the same calls from the same source for the same build
    (their "made", "why", "measured" and entry speedups aside): a redeploy whose new table is the
    same as the one on the host writes nothing. A None (no table, or one that is unreadable) is
    the same as nothing else."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    try:
        return _routing(a) == _routing(b)
    except (AttributeError, TypeError):
        return False


def shape_text(entry: dict) -> str:
    """'64:2:4:float32 b<=8' (or '... any batch') of an entry, as status prints it."""
    batch = "any batch" if entry.get("max_batch") is None else f"b<={entry['max_batch']}"
    return f"{entry['head_dim']}:{entry['group']}:{entry['draft_tokens']}:{entry['dtype']} {batch}"


def describe(table, key: str | None) -> str:
    """One line of what `table` (as read from the host: a dict, None for none, or {"error": why}
    when unreadable) routes for the active build `key`, and where it came from:
    'routes all shapes (operator: --route all, 2026-...)', 'routes 64:2:4:float32 b<=8 (measured
    on DEVICE, 2026-...)', 'routes nothing (no GPU to measure on)' (the why up to its first
    colon); a table of another build, another schema, or none routes nothing, saying why."""
    if table is None:
        return "routes nothing (no dispatch table)"
    if not isinstance(table, dict) or "error" in table:
        return f"routes nothing (dispatch table unreadable: {table.get('error') if isinstance(table, dict) else table})"
    if table.get("schema") != SCHEMA:
        return f"routes nothing (dispatch table of schema {table.get('schema')!r}, not {SCHEMA})"
    if table.get("build") != key:
        return f"routes nothing (the dispatch table is for build {str(table.get('build'))[:12]}, not the active one)"
    made, source = table.get("made") or "?", table.get("source")
    if source == "operator":
        where = f"operator: --route {table['route'] if table.get('route') == 'all' else ','.join(table.get('route') or [])}"
    elif source == "measured":
        m = table.get("measured") or {}
        where = f"measured on {m.get('device') or '?'}, >= {m.get('min_speedup', '?')}x"
    else:
        return f"routes nothing ({str(table.get('why') or 'no entries').split(':')[0]})"
    try:
        what = "all shapes" if table.get("all") is True else \
            ", ".join(shape_text(e) for e in table.get("entries") or []) or "nothing"
    except (KeyError, TypeError):
        what = "nothing (malformed entries)"
    return f"routes {what} ({where}, {made})"
