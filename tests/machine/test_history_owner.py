"""What the run store refuses that only root can set up: a history file, or its directory, that
belongs to another user (store.Store.open checks both owners against this process's euid before
SQLite opens the file). The rest of the store's tests are tests/unit/test_history_store.py."""

from __future__ import annotations

import os

import pytest

from conftest import require_lab
from fleetctl.history.store import HistoryError, Store


def _open_error(path) -> str:
    with pytest.raises(HistoryError) as e:
        Store.open(path).close()
    return str(e.value)


def test_a_history_or_its_directory_of_another_user_is_refused(tmp_path):
    require_lab()  # root, to chown (fails instead of skipping where CI requires it)
    home = tmp_path / "state" / "fleetctl"
    home.mkdir(parents=True, mode=0o700)
    path = home / "history.sqlite"
    os.chown(home, 4242, 4242)
    assert "owned by uid 4242" in _open_error(path)
    assert not path.exists()
    os.chown(home, os.geteuid(), os.getegid())
    Store.open(path).close()
    os.chown(path, 4242, 4242)
    assert "owned by uid 4242" in _open_error(path)
