"""Versions from what is on disk (issue 49, case 04): a site directory holding two dist-infos of
one distribution (an interrupted upgrade left the older one) or a stale one holding only REQUESTED
(python/cpython#100666) gives the version of the files that import, the dist-info whose RECORD
matches them for drift, and a warning naming the stale one; the same whichever name sorts (or the
file system lists) first. Fixture trees are built here, in tmp; locate and torchver run in a
child interpreter (`python -I`, as the facts probe runs them) so nothing of this process's
sys.path or import caches answers."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleetctl.probes.facts import distinfo, drift

AGENT = str(Path(__file__).resolve().parents[2] / "agent")


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def wheel_files(site: Path, name: str, version: str, files: dict[str, str], requested_only=False) -> Path:
    """The dist-info NAME-VERSION.dist-info in `site`: METADATA and a RECORD of `files` ({rel: text},
    hashed as given: a stale release's RECORD lists the texts of its own files); `requested_only`:
    one empty REQUESTED file and nothing else."""
    d = site / f"{name}-{version}.dist-info"
    d.mkdir(parents=True)
    if requested_only:
        (d / "REQUESTED").write_text("")
        return d
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nbody\n")
    rows = [f"{rel},sha256={b64(text.encode())},{len(text.encode())}" for rel, text in files.items()]
    (d / "RECORD").write_text("\n".join(rows + [f"{d.name}/METADATA,,", f"{d.name}/RECORD,,"]) + "\n")
    return d


def sglang_files(version: str) -> dict[str, str]:
    return {"sglang/__init__.py": f"# sglang {version}\nfrom sglang.version import __version__\n",
            "sglang/version.py": f'__version__ = "{version}"\n',
            "sglang/srt/model_executor/model_runner.py": f"# model runner of {version}\nNEED_SORT = False\n"}


def install(site: Path, version: str, stale: str | None) -> Path:
    """sglang `version`'s files and dist-info in `site`, plus the dist-info of release `stale` (its
    RECORD hashes that release's files, which are not there) when given."""
    for rel, text in sglang_files(version).items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    wheel_files(site, "sglang", version, sglang_files(version))
    if stale:
        wheel_files(site, "sglang", stale, sglang_files(stale))
    return site


def child(code: str, *path: Path) -> dict:
    """Run `code` (which prints JSON) in `python -I` with `path` first on sys.path, then agent/, then
    the standard library (no site-packages: this machine's own torch stays out of it)."""
    prelude = (f"import json, sys; sys.path[:] = {[str(p) for p in path] + [AGENT]!r} + "
               "[p for p in sys.path if not p.endswith('-packages')]\n")
    r = subprocess.run([sys.executable, "-I", "-c", prelude + code], capture_output=True, text=True, timeout=60,
                       cwd="/")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# "0.5.19" sorts before "0.5.23" (the stale one first, as tmpfs lists it) and "0.5.3" after it
@pytest.mark.parametrize("stale", ["0.5.19", "0.5.3"])
def test_two_sglang_dist_infos_give_the_installed_version_and_name_the_stale_one(tmp_path, stale):
    site = install(tmp_path / "site", "0.5.23", stale)
    chosen = distinfo.choose(str(site), "sglang", "sglang")
    assert chosen["path"] == str(site / "sglang-0.5.23.dist-info") and chosen["version"] == "0.5.23"
    assert [(Path(s["path"]).name, s["version"], s["why"]) for s in chosen["stale"]] == \
        [(f"sglang-{stale}.dist-info", stale, "its files are not the installed ones")]
    assert f"sglang-{stale}.dist-info (stale: its files are not the installed ones)" in chosen["warning"]
    assert "sglang-0.5.23.dist-info (matches the installed files)" in chosen["warning"]
    assert chosen["warning"].startswith(f"2 sglang dist-infos in {site}: ")
    # what the facts probe answers, from the install's own interpreter
    res = child("from fleetctl.probes.facts import locate; print(json.dumps(locate.locate(sys.argv[1:] or "
                f"[{str(site)!r}])))", site)
    sg = res["sglang"]
    assert (sg["version"], sg["install"], sg["location"]) == ("0.5.23", "wheel", str(site))
    assert sg["metadata_warning"] == chosen["warning"]
    # drift: judged against 0.5.23's RECORD (no file of it differs), the stale one named
    modified, err, warning = drift.problems(str(site), "sglang", {}, str(tmp_path / "state"))
    assert (modified, err, warning) == ([], None, chosen["warning"])
    (site / "sglang/srt/model_executor/model_runner.py").write_text("edited\n")
    modified, err, _ = drift.problems(str(site), "sglang", {}, str(tmp_path / "state"))
    assert modified == [{"path": str(site / "sglang/srt/model_executor/model_runner.py"),
                         "problem": "modified outside fleetctl"}]


def test_the_control_layout_has_no_warning(tmp_path):
    site = install(tmp_path / "site", "0.5.23", None)
    assert distinfo.choose(str(site), "sglang", "sglang") == {
        "path": str(site / "sglang-0.5.23.dist-info"), "version": "0.5.23", "stale": [], "warning": None}
    assert drift.problems(str(site), "sglang", {}, str(tmp_path / "state")) == ([], None, None)


def test_a_requested_only_dist_info_is_stale_and_the_version_comes_from_version_py(tmp_path):
    site = install(tmp_path / "site", "0.5.23", None)
    wheel_files(site, "sglang", "0.5.24", {}, requested_only=True)
    chosen = distinfo.choose(str(site), "sglang", "sglang")
    assert chosen["version"] == "0.5.23"
    assert chosen["stale"] == [{"path": str(site / "sglang-0.5.24.dist-info"), "version": None,
                                "why": "no RECORD, no METADATA: a leftover of a failed install"}]
    res = child(f"from fleetctl.probes.facts import locate; print(json.dumps(locate.locate([{str(site)!r}])))", site)
    assert res["sglang"]["version"] == "0.5.23" and "sglang-0.5.24.dist-info (stale: no RECORD, no METADATA" \
        in res["sglang"]["metadata_warning"]


def torch_tree(site: Path, version: str) -> None:
    files = {"torch/__init__.py": "# torch\n", "torch/version.py": f"__version__ = '{version}'\ncuda: str = '12.6'\n"}
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    wheel_files(site, "torch", version, files)


def test_torch_with_a_requested_only_dist_info_first_on_the_path(tmp_path):
    """cpython#100666: the venv's site-packages (first on sys.path) holds only
    torch-2.12.1+cu126.dist-info/REQUESTED; torch itself is in the system site-packages."""
    venv_site, system_site = tmp_path / "venv-site", tmp_path / "system-site"
    wheel_files(venv_site, "torch", "2.12.1+cu126", {}, requested_only=True)
    torch_tree(system_site, "2.12.1+cu126")
    got = child("from fleetctl.probes.facts import torchver; print(json.dumps(torchver.installed()))",
                venv_site, system_site)
    leftover = (venv_site / "torch-2.12.1+cu126.dist-info").resolve()
    assert got == {"version": "2.12.1+cu126", "cuda": "12.6", "metadata_warning": (
        f"torch dist-infos away from torch's own {system_site}: {leftover} (stale: no RECORD, no METADATA: a "
        "leftover of a failed install)")}
    # the same leftover beside torch itself: named, the version still what the files are
    wheel_files(system_site, "torch", "2.11.0", {}, requested_only=True)
    got = child("from fleetctl.probes.facts import torchver; print(json.dumps(torchver.installed()))", system_site)
    assert got["version"] == "2.12.1+cu126" and "torch-2.11.0.dist-info (stale: no RECORD, no METADATA" \
        in got["metadata_warning"]


def test_torch_without_a_version_says_why(tmp_path):
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("")
    wheel_files(site, "torch", "2.12.1", {}, requested_only=True)
    got = child("from fleetctl.probes.facts import torchver; print(json.dumps(torchver.installed()))", site)
    assert got["version"] is None and got["reason"].startswith(f"{site}/torch/version.py has no __version__ and no "
                                                                f"torch dist-info in {site} matches the installed files")


def test_release_is_what_the_files_are(tmp_path):
    site = install(tmp_path / "site", "0.5.10", "0.5.2")
    assert distinfo.release(str(site / "sglang")) == {"dist": "sglang", "version": "0.5.10"}
    (site / "sglang" / "version.py").unlink()  # no version module: the matching dist-info's
    wheel = site / "sglang-0.5.10.dist-info" / "RECORD"
    wheel.write_text("\n".join(l for l in wheel.read_text().splitlines() if "version.py" not in l) + "\n")
    assert distinfo.release(str(site / "sglang")) == {"dist": "sglang", "version": "0.5.10"}
    assert distinfo.release(str(tmp_path / "nothing")) is None


def test_a_vcs_versioning_version_module_is_read(tmp_path):
    """sglang 0.5.10 and 0.5.23: version.py imports _version.py (vcs-versioning's), whose constant says it."""
    site = install(tmp_path / "site", "0.5.23", None)
    (site / "sglang" / "version.py").write_text("try:\n    from sglang._version import __version__\nexcept ImportError:\n"
                                                "    __version__ = '0.0.0.dev0'\n")
    (site / "sglang" / "_version.py").write_text("version: str\n__version__: str\n__version__ = version = '0.5.23'\n")
    assert distinfo.version_py(str(site / "sglang")) == "0.5.23"
