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
    "config": 1, "paths": 1, "wheels": 1, "limits": 1,
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
# another. diagnose/ sits above traffic/: it drives the load gate's client during a profile.
PROBE_LAYERS = {"": 0, "facts": 1, "traffic": 2, "kernel": 2, "change": 2, "diagnose": 3}
# engine/ is layered the same way: the job runtime at its top (context, fleet, gather, containers,
# validate, load) under gates/ (the validation gates: the Gate protocol, smoke, load, route), under
# the change engine (changes, and ledger's rollback, recover and status jobs), under the two rooms
# that say what to change: playbooks/ (reader, model, tasks/, plan, patches, apply) and kernels/
# (package, deploy, dispatch, measure). Neither of those two imports the other.
ENGINE_LAYERS = {"": 0, "gates": 1, "changes": 2, "playbooks": 3, "kernels": 3}
CHANGE_ENGINE = {"changes", "ledger"}


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


def engine_room(module: str) -> str:
    """ENGINE_LAYERS' room of an engine module: its sub-package, "changes" for the change engine's
    modules, "" for the job runtime."""
    parts = module.split(".")  # fleetctl.engine[.room].module
    if len(parts) < 3:
        return ""
    if parts[2] in CHANGE_ENGINE:
        return "changes"
    return parts[2] if parts[2] in ENGINE_LAYERS else ""


def engine_arrows(g: dict[str, set[str]]) -> list[str]:
    """The engine's imports that run up ENGINE_LAYERS or sideways between two of its rooms."""
    return sorted(f"{m} -> {t}" for m, ts in g.items() if room(m) == "engine" for t in ts if room(t) == "engine"
                  if engine_room(m) != engine_room(t) and ENGINE_LAYERS[engine_room(t)] >= ENGINE_LAYERS[engine_room(m)])


def test_engine_rooms_import_down_and_never_sideways():
    g = graph()
    assert {engine_room(m) for m in modules() if room(m) == "engine"} == set(ENGINE_LAYERS)
    assert engine_arrows(g) == []
    # the rule catches an arrow up and one sideways, and lets one down pass
    e = "fleetctl.engine."
    assert engine_arrows({e + "gates.route": {e + "kernels.deploy"}, e + "kernels.measure": {e + "playbooks.plan"},
                          e + "playbooks.apply": {e + "gates", e + "changes", e + "fleet"}}) == [
        f"{e}gates.route -> {e}kernels.deploy", f"{e}kernels.measure -> {e}playbooks.plan"]


@pytest.mark.parametrize("g,want", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_circle_finder_finds_circles(g, want):
    assert circles(g) == want
