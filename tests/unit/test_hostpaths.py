"""fleetctl.hostpaths: a path or version a host reported, confined before the control node uses
it (security review N2, M7's control side), on every name of a real release and on hostile ones."""

from __future__ import annotations

import zipfile

import pytest

from fleetctl import hostpaths
from fleetctl.errors import HostFailed
from fleetctl.wheels import ensure_wheel, find_wheel


@pytest.mark.parametrize("rel, why", [
    ("../x", "not relative to the install"),
    ("/x", "not relative to the install"),
    ("sglang/../../x", "not relative to the install"),
    ("sglang/..", "not relative to the install"),
    ("/opt/venv/lib/python3.11/site-packages/sglang/a.py", "not relative to the install"),
    ("sglang/a\x00b", "holds the character U+0000"),
    ("sglang/a\nb", "holds the character U+000A"),
    ("sglang/a\rb.py", "holds the character U+000D"),
    ("sglang/\u202ea.py", "holds the character U+202E"),  # a bidi override: shows another name
    ("sglang/a\u2028b.py", "holds the character U+2028"),
    ("sglang//a.py", "not a normalised path"),
    ("sglang/./a.py", "not a normalised path"),
    ("sglang/a/", "not a normalised path"),
    ("x.py", "not under sglang/"),
    ("sglang", "not under sglang/"),
    ("", "not under sglang/"),
])
def test_package_file_refuses_what_is_not_a_file_of_the_install(rel, why):
    with pytest.raises(hostpaths.Refused) as e:
        hostpaths.package_file(rel)
    assert str(e.value) == f"refused a path from the host: {rel!r} ({why})"
    assert isinstance(e.value, HostFailed)  # in a host's job: that host failed, no traceback


def test_package_file_refuses_what_is_not_a_string():
    with pytest.raises(hostpaths.Refused) as e:
        hostpaths.package_file(["sglang/a.py"])
    assert str(e.value) == "refused a path from the host: ['sglang/a.py'] (not a string)"


def test_a_long_path_is_shown_cut():
    with pytest.raises(hostpaths.Refused) as e:
        hostpaths.package_file("../" * 1000)
    assert str(e.value) == f"refused a path from the host: {'../' * 40!r}... (not relative to the install)"


@pytest.mark.releases
@pytest.mark.parametrize("version", ["0.4.6.post5", "0.5.23"])
def test_every_file_of_a_release_passes(version):
    """Each sglang/ file in the release wheel (directory entries end in "/") is a file of the
    install as it is."""
    with zipfile.ZipFile(ensure_wheel(version)) as z:
        names = [n for n in z.namelist() if n.startswith("sglang/") and not n.endswith("/")]
    assert len(names) > 100
    assert [n for n in names if hostpaths.package_file(n) != n] == []


@pytest.mark.parametrize("version", ["0.4.6.post5", "0.5.23", "0.5.0rc2", "1!2.0", "0.5.10.dev3", "1.0a1.post2.dev0"])
def test_release_takes_canonical_public_versions(version):
    assert hostpaths.release(version) == version


@pytest.mark.parametrize("version", [
    "0.5.23\n", "0.5.23/../../x", "../x", "*", "0.5.*", "0.5.23 --index-url=http://x", "0.5.23;rm", "0.5.10+local",
    "v0.5.23", "0.5.23-post1", "00.5", "", "0.5.23\x00", 523,
])
def test_release_refuses_anything_else(version):
    with pytest.raises(hostpaths.Refused) as e:
        hostpaths.release(version)
    assert str(e.value) == (f"refused a version from the host: {version!r} (not a PEP 440 public version "
                            "in canonical form)")


def test_the_wheel_cache_takes_no_version_that_could_be_a_glob_or_a_path(tmp_path, monkeypatch):
    """find_wheel (and ensure_wheel, which pip-downloads `sglang==VERSION`) refuse a version that
    is not PEP 440's before it reaches a glob, a file name or pip."""
    monkeypatch.setenv("FLEETCTL_WHEEL_CACHE", str(tmp_path))
    (tmp_path / "sglang-0.5.23-py3-none-any.whl").write_bytes(b"")
    assert find_wheel("0.5.23") == tmp_path / "sglang-0.5.23-py3-none-any.whl"
    for version in ("*", "0.5.2[0-9]", "0.5.23 --pre"):
        with pytest.raises(hostpaths.Refused):
            find_wheel(version)
        with pytest.raises(hostpaths.Refused):
            ensure_wheel(version)


@pytest.mark.parametrize("text", ["host:/opt/venv\n--- a/sglang/evil.py", "docker:a\x1b[2Kb:/x", "host:/x\u2029y"])
def test_printable_refuses_line_breaks_and_controls(text):
    with pytest.raises(hostpaths.Refused) as e:
        hostpaths.printable(text, "an install id")
    assert str(e.value).startswith(f"refused an install id from the host: {text!r} (holds the character U+")
    assert hostpaths.printable("docker:web-1:/usr/lib/python3/dist-packages", "an install id") == \
        "docker:web-1:/usr/lib/python3/dist-packages"
