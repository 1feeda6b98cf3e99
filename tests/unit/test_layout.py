"""The package's layout, read from its imports with `ast` (every import, the lazy ones inside
functions included): no import circle between modules, and no import from a lower layer to a
higher one (README.md's layout section draws the layers)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "agent" / "fleetctl"

# Each top-level room of the package and its layer: a module may import only its own layer's
# rooms or lower ones. probes/ are sent to hosts (stdlib only) and import nothing of fleetctl's
# outside probes/; lab/ is a demo wing that only the CLI's lab commands (cli/lab.py) import.
LAYERS = {
    "errors": 0, "vocab": 0, "hostpaths": 0, "probes": 0,
    "config": 1, "paths": 1, "wheels": 1,
    "inventory": 2,
    "connection": 3,
    "engine": 4,
    "lab": 5, "collection": 5, "history": 5, "report": 5,
    "cli": 6,
    "__init__": 0, "data": 0,
}
LAB_IMPORTERS = {"fleetctl.cli.lab"}
# probes/ has rooms of its own, layered the same way: the runtime at its top (the bundler, result,
# trust, safefs, redact, enter) under facts/ (read-only), under traffic/, kernel/ and change/
# (which send requests, build or write, reading facts to do so). None of the upper three imports
# another.
PROBE_LAYERS = {"": 0, "facts": 1, "traffic": 2, "kernel": 2, "change": 2}
# engine/ has one sub-room, gates/ (the validation gates: the Gate protocol and its smoke, load and
# route gates). Its modules use the engine modules below it (context, validate, load, ...); of the
# engine's own modules only the change engine and the two commands that arm gates import it, and
# it imports none of those three.
GATES = "fleetctl.engine.gates"
GATE_USERS = {"fleetctl.engine.changes", "fleetctl.engine.apply", "fleetctl.engine.deploy"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts}


def imports(path: Path, known: set[str]) -> set[str]:
    """The fleetctl modules that `path` imports anywhere in it (a package's submodule named in
    `from pkg import sub` counts as that submodule)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "fleetctl"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "fleetctl":
                target = node.module
            else:
                continue
            subs = {f"{target}.{a.name}" for a in node.names} & known
            out |= subs or {target}
    return {m for m in out if m in known and m != me}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(p, set(mods)) for m, p in mods.items()}


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_every_room_has_a_layer():
    assert {room(m) for m in modules()} <= set(LAYERS), "a new top-level room: give it a layer in LAYERS"


def test_no_import_circle():
    assert circles(graph()) == []


def test_no_import_from_a_lower_layer_to_a_higher_one():
    back = sorted(f"{m} -> {t}" for m, ts in graph().items() for t in ts
                  if LAYERS[room(t)] > LAYERS[room(m)])
    assert back == []


def test_probes_import_only_probes_and_the_lab_only_from_its_cli_commands():
    g = graph()
    assert sorted(f"{m} -> {t}" for m, ts in g.items() if room(m) == "probes" for t in ts if room(t) != "probes") == []
    assert {m for m, ts in g.items() if any(room(t) == "lab" for t in ts) and room(m) != "lab"} <= LAB_IMPORTERS


def probe_room(module: str) -> str:
    parts = module.split(".")  # fleetctl.probes[.room].module
    return parts[2] if len(parts) > 3 or module.endswith(tuple(f".{r}" for r in PROBE_LAYERS if r)) else ""


def test_probe_rooms_import_down_and_never_sideways():
    g = graph()
    edges = [(probe_room(m), probe_room(t), f"{m} -> {t}") for m, ts in g.items() if room(m) == "probes"
             for t in ts if room(t) == "probes"]
    assert {probe_room(m) for m in modules() if room(m) == "probes"} <= set(PROBE_LAYERS)
    assert sorted(e for a, b, e in edges if a != b and PROBE_LAYERS[b] >= PROBE_LAYERS[a]) == []


def in_gates(module: str) -> bool:
    return module == GATES or module.startswith(GATES + ".")


def gate_arrows(g: dict[str, set[str]]) -> list[str]:
    """The imports that break the engine's gates rule (GATES, GATE_USERS): an engine module other
    than GATE_USERS that imports gates/, and gates/ importing one of GATE_USERS."""
    engine = {m for m in g if room(m) == "engine"}
    return sorted([f"{m} -> {t}" for m in engine - GATE_USERS if not in_gates(m) for t in g[m] if in_gates(t)]
                  + [f"{m} -> {t}" for m in engine if in_gates(m) for t in g[m] if t in GATE_USERS])


def test_only_the_change_engine_and_its_commands_import_the_gates_and_the_gates_import_neither():
    g = graph()
    assert {GATES, GATES + ".smoke", GATES + ".load", GATES + ".route"} <= set(g)
    assert gate_arrows(g) == []
    # the rule catches both directions
    assert gate_arrows({"fleetctl.engine.measure": {GATES + ".smoke"}, GATES + ".route": {"fleetctl.engine.deploy"},
                        "fleetctl.engine.apply": {GATES}, GATES: set(), GATES + ".smoke": set(),
                        "fleetctl.engine.deploy": set()}) == [
        f"{GATES}.route -> fleetctl.engine.deploy", f"fleetctl.engine.measure -> {GATES}.smoke"]


@pytest.mark.parametrize("g,want", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_circle_finder_finds_circles(g, want):
    assert circles(g) == want
