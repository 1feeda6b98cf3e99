"""The documentation's runnable examples (docs/examples/*.t, shown on the site's Examples page)
run against a lab as written: prysk (the maintained cram) runs each command with `sh` and
compares its output with the file, `(re)` and `(glob)` lines standing for what differs between
runs (change ids, temporary paths). The lab is one host of SGLang 0.5.23 with the stand-in server,
its own for this module (id FLEETCTL_TEST_LAB_ID + 100, which test_fleet_installs' module also
uses: never up at once). prysk is the one `bash scripts/docs.sh install` pins (scripts/setup.sh
runs it). tests/unit/test_docs_pages.py checks that the examples are there and on the page."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, TEST_LAB_ID, running_lab
from fleetctl.wheels import cache_dir

LAB_ID = (TEST_LAB_ID + 100) % 256
RELEASE = "0.5.23"
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.t"))


@pytest.fixture(scope="module")
def docs_lab(lab_machine, tmp_path_factory):
    with running_lab(tmp_path_factory.mktemp("home-docs"), LAB_ID, [RELEASE], hosts=1, with_server=True) as up:
        yield up


def _fleetctl_on_path(bin_dir: Path) -> Path:
    """A `fleetctl` command in `bin_dir` that runs this checkout's fleetctl with this interpreter, as
    `pip install .` would put one on PATH."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    shim = bin_dir / "fleetctl"
    shim.write_text(f'#!/bin/sh\nPYTHONPATH={ROOT / "agent"} exec {sys.executable} -m fleetctl.cli "$@"\n')
    shim.chmod(0o755)
    return bin_dir


def test_every_example_runs_on_the_lab_as_written(docs_lab, tmp_path):
    prysk = cache_dir() / "venvs" / "docs" / "bin" / "prysk"
    assert prysk.exists(), f"{prysk}: run `bash scripts/setup.sh` (or `bash scripts/docs.sh install`)"
    env = dict(docs_lab.env, PATH=f"{_fleetctl_on_path(tmp_path / 'bin')}{os.pathsep}{os.environ['PATH']}",
               FLEETCTL_HISTORY=str(tmp_path / "history.sqlite"), COLUMNS="120", LANG="C.UTF-8", TZ="UTC")
    out = subprocess.run([str(prysk), "--preserve-env", "--color", "never", "--indent", "2", *map(str, EXAMPLES)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    for err in (ROOT / "docs" / "examples").glob("*.t.err"):
        err.unlink()  # prysk's copy of a failed run beside the file: the diff below says it all
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-2000:]
    assert f"# Ran {len(EXAMPLES)} tests, 0 skipped, 0 failed." in out.stdout
