"""Probe bundles derived from the probes' own imports (probes.modules_for), run as the host runs them."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleetctl import probes

PROBE_DIR = Path(probes.__file__).parent
ALL = sorted(".".join(p.relative_to(PROBE_DIR).with_suffix("").parts) for p in PROBE_DIR.rglob("*.py")
             if p.name != "__init__.py" and "__pycache__" not in p.parts)


def run(doc: dict, **env) -> dict:
    """`doc` (a bundle's JSON document) on stdin of `python -S -c WRAPPER`: its parsed result."""
    r = subprocess.run([sys.executable, "-S", "-c", probes.WRAPPER], input=json.dumps(doc).encode(),
                       capture_output=True, timeout=120, env=env or None)
    return probes.parse_output(r.stdout, r.stderr, r.returncode)


def test_the_bundles_are_the_probes_imports_in_load_order():
    assert probes.modules_for("change.actions") == ["safefs", "facts.scancache", "change.ledger", "result", "runas",
                                                    "evidence", "facts.distinfo", "facts.drift", "change.actions"]
    assert probes.modules_for("traffic.smoke") == ["redact", "facts.listeners", "facts.topology", "facts.pd", "result", "safefs",
                                                   "runas", "facts.procs", "bounded", "enter", "facts.containers", "facts.targets",
                                                   "traffic.smoke"]
    assert probes.modules_for("kernel.kbuild") == ["result", "safefs", "runas", "kernel.copy", "kernel.proc",
                                                   "kernel.build", "bounded", "facts.gpus", "facts.distinfo", "facts.torchver",
                                                   "kernel.preflight",
                                                   "evidence", "kernel.publish", "kernel.state", "kernel.kbuild"]
    assert probes.modules_for("facts.gittree") == ["facts.gittree"]
    for main in ALL:
        mods = probes.modules_for(main)
        assert mods[-1] == main and len(set(mods)) == len(mods)
        for i, m in enumerate(mods):  # each after what it imports, and nothing it does not need
            assert set(probes.imports(m)) <= set(mods[:i]), (main, m)
        # the code cache comes as early as it can: the modules after it are kept compiled
        if probes.CODE_CACHE in mods:
            assert mods[:mods.index(probes.CODE_CACHE) + 1] == probes.modules_for(probes.CODE_CACHE), main


def test_only_code_cache_bundles_carry_a_code_key():
    import zlib
    for main, keyed in (("facts.host", True), ("change.actions", True), ("facts.scancache", True),
                        ("traffic.smoke", False), ("kernel.kbuild", False)):
        doc = json.loads(zlib.decompress(probes.bundle(main, {})))
        assert [m for m, _ in doc["modules"]] == probes.modules_for(main)
        assert doc.get("code_key") == (probes.sources_sha256(probes.modules_for(main)) if keyed else None), main


@pytest.mark.parametrize("main,params,check", [
    ("change.actions", {"action": "status", "state_dir": "STATE"}, lambda r: r["ok"] and r["changes"] == []),
    ("kernel.kbuild", {"action": "state", "link": "STATE/current", "build_dir": "STATE"},
     lambda r: r == {"current": None, "passed": False}),
    ("traffic.smoke", {"servers": []}, lambda r: isinstance(r, dict)),
])
def test_a_derived_bundle_runs_and_one_missing_any_import_does_not(tmp_path, main, params, check):
    """The derived bundle runs under the wrapper (each module's `from . import x`, `from .. import x`
    and `from ..room import x` find the modules loaded before it, in their rooms); leaving out any
    module it names fails with that module's name."""
    params = {k: v.replace("STATE", str(tmp_path / "state")) if isinstance(v, str) else v for k, v in params.items()}
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    doc = probes.document(main, params)
    assert check(run(doc, **env))
    for left_out in probes.modules_for(main)[:-1]:
        short = dict(doc, modules=[[m, s] for m, s in doc["modules"] if m != left_out])
        with pytest.raises(probes.ProbeError, match=f"ImportError: cannot import name '{left_out.rpartition('.')[2]}'"):
            run(short, **env)


def test_a_probe_imports_other_probes_one_way_only(tmp_path, monkeypatch):
    monkeypatch.setattr(probes, "source", {"a": "from .b import c\n"}.__getitem__)
    probes.imports.cache_clear()
    try:
        for bad in ("from .b import c\n", "from ... import c\n", "from ..facts.x import c\n"):
            monkeypatch.setattr(probes, "source", {"a": bad, "r.a": bad}.__getitem__)
            probes.imports.cache_clear()
            with pytest.raises(ValueError, match="line 1: probes import each other as `from . import x`, "):
                probes.imports("r.a")
        rooms = {"r.a": "from . import b\nfrom .. import c\nfrom ..s import d\n"}
        monkeypatch.setattr(probes, "source", rooms.__getitem__)
        probes.imports.cache_clear()
        assert probes.imports("r.a") == ("r.b", "c", "s.d")
        circle = {"a": "from . import b\n", "b": "def f():\n    from . import a\n"}
        monkeypatch.setattr(probes, "source", circle.__getitem__)
        probes.imports.cache_clear()
        probes._load_order.cache_clear()
        with pytest.raises(ValueError, match="probe imports go in a circle: a -> b -> a"):
            probes.modules_for("a")
    finally:
        probes.imports.cache_clear()
        probes._load_order.cache_clear()


def whole_source_imports(name: str) -> tuple[str, ...]:
    """A second reading: every relative ImportFrom in the probe's whole ast, in source order."""
    nodes = [n for n in ast.walk(ast.parse(probes.source(name))) if isinstance(n, ast.ImportFrom) and n.level]
    found: list[str] = []
    here = name.split(".")[:-1]
    for n in sorted(nodes, key=lambda n: (n.lineno, n.col_offset)):
        room = here[:len(here) - n.level + 1] + ([n.module] if n.module else [])
        found += [m for m in (".".join(room + [a.name]) for a in n.names) if m not in found]
    return tuple(found)


@pytest.mark.parametrize("name", ALL)
def test_the_import_reading_equals_the_whole_source_ast(name):
    assert probes.imports(name) == whole_source_imports(name)


def test_parenthesised_and_indented_imports_are_read(monkeypatch):
    texts = {"a": "import os\n\ndef f():\n    from . import (b,\n                   c)  # two\n"
                  "x = 'from . import d'\n", "b": "", "c": "", "d": ""}
    monkeypatch.setattr(probes, "source", texts.__getitem__)
    probes.imports.cache_clear()
    try:
        assert probes.imports("a") == ("b", "c") == whole_source_imports("a")
    finally:
        probes.imports.cache_clear()


def test_locate_never_imports_a_module_from_the_servers_directory(tmp_path):
    """The facts probe asks an interpreter where `import sglang` resolves with a server's working
    directory first (any user's files): a module planted there under a name the standard
    library imports lazily (email, which importlib.metadata reads a version with) is never
    imported, and sys.path is the interpreter's own again afterwards (review round 3)."""
    proj = tmp_path / "proj"
    (proj / "sglang").mkdir(parents=True)
    (proj / "sglang" / "__init__.py").write_text("")
    dist = proj / "sglang-0.4.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.4.0\n")
    (dist / "RECORD").write_text("sglang/__init__.py,,\n")  # a wheel's: its version is read from METADATA
    mark = tmp_path / "imported"
    for name in ("email", "string", "csv"):
        (proj / name).mkdir()
        (proj / name / "__init__.py").write_text(f"open({str(mark)!r}, 'a').write({name!r})\n")
    doc = probes.document("facts.host", {"locate": [str(proj)]})
    r = subprocess.run([sys.executable, "-I", "-c", probes.WRAPPER], input=json.dumps(doc).encode(),
                       capture_output=True, timeout=120, cwd="/")
    res = probes.parse_output(r.stdout, r.stderr, r.returncode)
    assert res["sglang"]["package_dir"] == str(proj / "sglang") and res["sglang"]["version"] == "0.4.0", res
    assert not mark.exists(), mark.read_text()
    # in this process: the entries are on sys.path only for find_spec (whatever this Python
    # imports lazily afterwards comes from its own path)
    from fleetctl.probes.facts import locate
    before = list(sys.path)
    assert locate.locate([str(proj)])["sglang"]["version"] == "0.4.0"
    assert sys.path == before
