#!/usr/bin/env bash
# The documentation site (mkdocs.yml, docs/): MkDocs with the Material theme.
#
#   bash scripts/docs.sh [build] [MKDOCS-ARGS]   install what the site needs, then build it strictly
#                                                (warnings are errors: a broken link, a missing page)
#                                                into site/ (`-d DIR` elsewhere)
#   bash scripts/docs.sh serve [MKDOCS-ARGS]     the same, then serve it on http://127.0.0.1:8000
#   bash scripts/docs.sh install                 only install (scripts/setup.sh runs this)
#
# mkdocs-material and prysk (the runner of the examples in docs/examples/*.t:
# tests/fleet/test_docs_examples.py), pinned, go into a venv of their own in the wheel cache,
# <cache>/venvs/docs (fleetctl's own Python is left alone), made again only when what it holds
# would change (.fleetctl-ready holds that). The reference pages are generated from the
# code beforehand: python3 scripts/gen_reference.py (tests/unit/test_docs_reference.py checks them).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WANT="mkdocs==1.6.1 mkdocs-material==9.8.2 prysk==0.20.0"
venv=$(PYTHONPATH=agent "$PY" -c 'from fleetctl.wheels import cache_dir; print(cache_dir() / "venvs" / "docs")')
want="$WANT ($("$PY" -VV | head -1))"
if [ "$(cat "$venv/.fleetctl-ready" 2>/dev/null)" != "$want" ]; then
    rm -rf "$venv"
    "$PY" -m venv "$venv"
    # shellcheck disable=SC2086  # word splitting: each requirement is one argument
    "$venv/bin/python" -m pip install -q --disable-pip-version-check $WANT
    echo "$want" > "$venv/.fleetctl-ready"
fi
export NO_MKDOCS_2_WARNING=1  # Material's notice about its successor, printed on every run
mode=${1:-build}
[ $# -gt 0 ] && shift
case "$mode" in
    install) ;;
    build) exec "$venv/bin/mkdocs" build --strict "$@" ;;
    serve) exec "$venv/bin/mkdocs" serve --strict "$@" ;;
    *) echo "usage: bash scripts/docs.sh [build|serve|install] [MKDOCS-ARGS]" >&2; exit 2 ;;
esac
