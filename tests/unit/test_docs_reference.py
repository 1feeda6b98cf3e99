"""The site's reference pages are generated from the code (scripts/gen_reference.py) and kept
committed: each must be what the generator writes now, so a command, option, inventory var or error
added without `python3 scripts/gen_reference.py` fails here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    """scripts/gen_reference.py, loaded as a module (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _generator()


@pytest.mark.parametrize("page", sorted(GEN.PAGES))
def test_each_generated_page_is_what_the_generator_writes_now(page):
    committed = (ROOT / page).read_text(encoding="utf-8")
    assert committed == GEN.PAGES[page](), f"{page} is stale: run `python3 scripts/gen_reference.py` and commit it"


def test_a_command_or_option_added_without_regenerating_is_caught(monkeypatch):
    from fleetctl.cli import app

    monkeypatch.setattr(app, "registered_commands", list(app.registered_commands))

    @app.command("docs-canary")
    def canary(flag: bool = False) -> None:
        """A command the committed reference does not know."""

    page = GEN.cli_page()
    assert "`fleetctl docs-canary`" in page and "`--flag`" in page
    assert page != (ROOT / "docs/reference/cli.md").read_text(encoding="utf-8")
    assert GEN.main(["--check"]) == 1


def test_every_command_and_option_is_in_the_reference():
    """Walks click's tree itself: every command path and every option name is in cli.md."""
    import typer.main
    from fleetctl.cli import app

    text = (ROOT / "docs/reference/cli.md").read_text(encoding="utf-8")
    missing = []
    for path, cmd in GEN._commands(typer.main.get_command(app), ("fleetctl",)):
        if f"`{' '.join(path)}`" not in text:
            missing.append(" ".join(path))
        for p in cmd.params:
            for opt in getattr(p, "opts", []) if p.param_type_name == "option" else []:
                if f"`{opt}`" not in text:
                    missing.append(f"{' '.join(path)} {opt}")
    assert not missing, missing
