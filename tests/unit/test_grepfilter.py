"""The scan's two prefilters agree (issue 55): the host's GNU grep (probes/facts/grepfilter.py)
and the Python read (callsites.file_entry) give the same scan and the same cache entries, on
every release tree and on a hostile one; where grep cannot vouch for its answer the scan falls
back to Python. No timing is asserted here (bench/inspect_vs_ssh.py measures the speed)."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest

from fleetctl.probes.facts import callsites, grepfilter
from fleetctl.wheels import ensure_wheel

RELEASES = ["0.4.6.post5", "0.5.2", "0.5.10", "0.5.23"]


def both(location: str) -> tuple[dict, dict, dict, dict]:
    """(Python scan, its cache, grep scan, its cache) of `location`, phases_s and the cache's
    `changed` flag set aside (they differ run to run); the grep scan's phases_s is returned
    under "phases_s" for the caller to check which prefilter ran. Every entry is kept in the
    caches (RACY_S lifted: the files were all written a moment ago)."""
    caches, scans = [{}, {}], []
    racy, callsites.RACY_S = callsites.RACY_S, -3600.0
    for cache, use_grep in zip(caches, (False, True)):
        r = callsites.scan(location, cache=cache, workers=1, use_grep=use_grep)
        r["cache"].pop("changed")
        scans.append(r)
    callsites.RACY_S = racy
    phases = scans[1].pop("phases_s")
    scans[0].pop("phases_s")
    return scans[0], caches[0], dict(scans[1], phases_s=phases), caches[1]


def test_the_lab_machine_has_a_trusted_gnu_grep():
    """The fast path is what these tests compare: root's GNU grep must be found here."""
    assert grepfilter.system_grep() in grepfilter.GREPS


@pytest.mark.releases
@pytest.mark.parametrize("version", RELEASES)
def test_grep_and_python_prefilters_agree_on_every_release(tmp_path, version):
    with zipfile.ZipFile(ensure_wheel(version)) as z:
        z.extractall(tmp_path, [n for n in z.namelist() if n.startswith("sglang/") and n.endswith(".py")])
    py, py_cache, fast, fast_cache = both(str(tmp_path))
    assert "prefilter_grep" in fast.pop("phases_s")
    assert fast == py and fast_cache == py_cache
    assert py["allocator_call_sites"] and len(py_cache) == py["stats"]["files_total"]


def hostile_tree(root: Path) -> Path:
    """A package of GREP_MIN_FILES plain files and everything a prefilter could get wrong."""
    pkg = root / "sglang"
    (pkg / "sub").mkdir(parents=True)
    for i in range(callsites.GREP_MIN_FILES):
        (pkg / "sub" / f"f{i}.py").write_text(f"class C{i}(object):\n    pass\n\tclass  D{i}: pass\n")
    files = {
        "alloc.py": "class BaseTokenToKVPoolAllocator:\n    def __init__(self, need_sort=False):\n        pass\n",
        "use.py": "from .alloc import BaseTokenToKVPoolAllocator as A\nA(need_sort=True)\n",
        "crlf.py": "class Crlf:\r\n    pass\r\nclass\tTabbed(Crlf):\r\n    x = 1\r\n",
        "nul.py": "x = '\0'\nneed_sort = 1\n",  # a NUL byte: grep must still read it as text
        "nulclass.py": "y = '\0'\nclass AfterNul: pass\n",
        "classword.py": "class need_sortLike:\n    pass\n",  # the needle inside a class line
        "notclass.py": "x = 1; class_ = 2\n  classy = 3\n#class Commented\nclass9 = 1\n",
        ".py": "class Hidden: pass\n",
        ".hidden.py": "need_sort = 2\n",
        "star*[x].py": "class Star: pass\n",
        "new\nline.py": "need_sort = 3\nclass NewLine: pass\n",
        "space name.py": "class Spaced: pass\n",
        "latin1.py": "# -*- coding: latin-1 -*-\nclass Caf\xe9: pass\nneed_sort = '\xe9'\n",
        "tests/skipped.py": "need_sort = 4\n",
        "__pycache__/x.py": "need_sort = 5\n",
        "notpy.txt": "need_sort = 6\n",
        "big.py": "class Big: pass\n" + "# padding\n" * 400 + "need_sort = 7\n",
    }
    for rel, text in files.items():
        p = pkg / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text.encode("latin-1"))
    (pkg / os.fsdecode(b"bad\xffname.py")).write_bytes(b"class BadName: pass\nneed_sort = 8\n")
    outside = root / "outside.py"
    outside.write_text("need_sort = 9\nclass Outside: pass\n")
    (pkg / "link.py").symlink_to(outside)
    os.mkfifo(pkg / "fifo.py")
    (root / "elsewhere").mkdir()
    (root / "elsewhere" / "e.py").write_text("need_sort = 10\n")
    (pkg / "linkdir").symlink_to(root / "elsewhere", target_is_directory=True)
    return root


def test_grep_and_python_prefilters_agree_on_a_hostile_tree(tmp_path, monkeypatch):
    monkeypatch.setattr(callsites, "MAX_SOURCE_BYTES", 2000)  # big.py is over it: an error either way
    py, py_cache, fast, fast_cache = both(str(hostile_tree(tmp_path)))
    assert "prefilter_grep" in fast.pop("phases_s")
    assert fast == py and fast_cache == py_cache
    errors = {e["file"] for e in py["parse_errors"]}
    assert {"sglang/big.py", "sglang/fifo.py", "sglang/link.py", "sglang/linkdir", "sglang/nul.py"} <= errors
    assert py_cache["sglang/nul.py"]["candidate"] is True  # found past its NUL byte; ast refuses it
    assert py_cache["sglang/crlf.py"]["class_names"] == ["Crlf", "Tabbed"]
    assert py_cache["sglang/nulclass.py"]["class_names"] == ["AfterNul"]
    assert py_cache["sglang/classword.py"]["candidate"] is True
    assert py_cache["sglang/notclass.py"]["class_names"] == []
    assert py_cache["sglang/sub/f0.py"]["class_names"] == ["C0", "D0"]
    origins = {o["file"] for o in py["need_sort_origins"]}
    assert {"sglang/.hidden.py", "sglang/new\nline.py", "sglang/latin1.py",
            "sglang/" + os.fsdecode(b"bad\xffname.py")} <= origins
    assert not origins & {"sglang/tests/skipped.py", "sglang/__pycache__/x.py", "sglang/link.py"}


def test_an_untrusted_grep_or_an_answer_over_its_bound_falls_back_to_python(tmp_path, monkeypatch):
    loc = str(hostile_tree(tmp_path))
    py, py_cache, _, _ = both(loc)
    mine = tmp_path / "grep"  # this user's, not root's: never run as the prefilter
    mine.symlink_to("/usr/bin/grep")
    with monkeypatch.context() as m:
        m.setattr(grepfilter, "GREPS", (str(mine),))
        assert grepfilter.system_grep() is None
        _, _, fast, fast_cache = both(loc)
        assert "prefilter" in fast.pop("phases_s") and fast == py and fast_cache == py_cache
    monkeypatch.setattr(grepfilter, "MAX_OUTPUT_BYTES", 100)
    assert grepfilter.prefilter(grepfilter.system_grep(), loc + "/sglang", [(loc + "/sglang/use.py",)],
                                callsites._NEEDLES, callsites._SKIP_DIRS, 1 << 20) is None
    _, _, fast, fast_cache = both(loc)
    assert "prefilter" in fast.pop("phases_s") and fast == py and fast_cache == py_cache
