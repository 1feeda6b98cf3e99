"""Hosts for tests: a local one loaded as fleetctl loads an inventory; the lab's stand-in imported
by path (as a host runs it), or started through a wrapper that passes it only the options it knows."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from fleetctl import inventory
from fleetctl.lab import standin


def local_host(tmp_path: Path, name: str = "here", **hostvars) -> inventory.Host:
    """A one-host inventory written to tmp_path/NAME.yaml with `ansible_connection: local` and
    `hostvars` (values as JSON, which YAML reads), loaded with inventory.load: the Host fleetctl
    would get for it."""
    lines = "".join(f"      {k}: {json.dumps(v)}\n" for k, v in hostvars.items())
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"all:\n  hosts:\n    {name}:\n      ansible_connection: local\n{lines}")
    return inventory.load(path).select(name)[0]


def standin_wrapper(options: tuple[str, ...]) -> str:
    """The text of a Python script that starts the lab's STAND-IN server (not SGLang: a lab host
    has no GPU) from /opt/fleetctl-standin with only `options` (e.g. ("--host", "--port")) of
    its command line: the rest of that command line is there for fleetctl to read from /proc
    (an --api-key, SGLang's options)."""
    return ("import argparse, sys\n"
            "sys.path.insert(0, \"/opt/fleetctl-standin\")\n"
            "import server\n"
            "p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)\n"
            f"for o in {tuple(options)!r}:\n"
            "    p.add_argument(o)\n"
            "known, _ = p.parse_known_args()\n"
            "server.main([w for k, v in vars(known).items() for w in (\"--\" + k.replace(\"_\", \"-\"), v)])\n")


def load_standin(path: Path = standin.SERVER):
    """The stand-in's server.py or engine.py (a path in standin.DIR) imported by path as a module
    of its own, not as part of fleetctl: as a lab host runs it, with standin.DIR first on sys.path
    while it is imported (where server.py finds engine.py). Returns the module; raises what its
    import raises."""
    sys.path.insert(0, str(standin.DIR))
    try:
        spec = importlib.util.spec_from_file_location("fleetctl_standin_" + path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(standin.DIR))
    return mod
