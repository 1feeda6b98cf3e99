"""The documentation site builds strictly (`bash scripts/docs.sh`: `mkdocs build --strict`, every
warning an error), and a broken link or anchor fails that build. The pinned mkdocs-material venv is
the one scripts/setup.sh makes (`bash scripts/docs.sh install`); pip is kept off the index here, so
a missing venv is an error naming the fix rather than a download."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _docs(*args: str) -> subprocess.CompletedProcess:
    """`bash scripts/docs.sh ARGS`, offline, its output captured."""
    env = dict(os.environ, PIP_NO_INDEX="1")
    return subprocess.run(["bash", "scripts/docs.sh", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def _nav_pages(nav) -> list[str]:
    """Every page mkdocs.yml's nav names, in order."""
    pages = []
    for item in nav:
        for value in (item.values() if isinstance(item, dict) else [item]):
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_the_site_builds_strictly_with_every_page_of_its_nav(tmp_path):
    out = _docs("build", "-d", str(tmp_path / "site"))
    assert out.returncode == 0, (
        f"the strict build failed (run `bash scripts/setup.sh` if the venv is missing):\n{out.stdout}{out.stderr}")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = _nav_pages(config["nav"])
    assert len(pages) >= 25
    for page in pages:
        html = tmp_path / "site" / page.replace(".md", ".html")
        assert html.is_file(), f"{page} was not built"
    # the generated reference and the included files are in the built pages
    assert "fleetctl apply" in (tmp_path / "site/reference/cli.html").read_text()
    assert "need_sort becomes True" in (tmp_path / "site/reference/formats.html").read_text()
    assert "R4-1" in (tmp_path / "site/changelog.html").read_text()


def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with open(tmp_path / "docs/lab.md", "a") as f:
        f.write("\nSee [the missing page](guides/no-such-guide.md) and "
                "[a lost section](security.md#no-such-section).\n")
    out = _docs("build", "-f", str(tmp_path / "mkdocs.yml"), "-d", str(tmp_path / "site"))
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "guides/no-such-guide.md" in text and "#no-such-section" in text
    assert "strict mode" in text
