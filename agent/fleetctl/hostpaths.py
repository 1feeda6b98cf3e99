"""What a host reports that the control node puts into its own file names, confined first.

A host's answer is its root's to choose (the python3 that runs the probe is theirs), and a
container's is the container's. Before the control node joins a host-given name to a directory
of its own (`apply --export-patch` builds the install's files in a temporary copy and writes
patch files) or into a patch that `patch` reads, the name passes one of these (security review
N2, and M7's control side):

- `package_file`: every file a finding names and every key of an install's scan `files` and
  `sources` is relative to the install's location (the directory holding sglang/), as the inspect
  probe makes it (probes/facts/callsites.py: "sglang" + the walk's relative path): a normalised
  relative POSIX path under sglang/, no `..`, not absolute, no empty or `.` component.
- `release`: the SGLang version, which names patch files and wheels (`sglang-VERSION-*.whl`, a
  glob) and goes to `pip download sglang==VERSION`: a PEP 440 public version in canonical form,
  which holds only digits, dots and the letters of a/b/rc/post/dev, and `!`.
- `printable`: any other host text that goes into a file `patch` reads (an install id).

Each also refuses every character str.isprintable() refuses (NUL, line breaks, C0/C1 controls,
Unicode format characters such as the bidi overrides, separators other than the space).
"""

from __future__ import annotations

import posixpath
import re

from .errors import HostFailed

PACKAGE = "sglang/"

# PEP 440 appendix B, "is_canonical": a canonical public version (no local part, no leading
# zeros, no separators but dots), matched whole (re.fullmatch: `$` would take a final newline).
CANONICAL_VERSION = re.compile(r"([1-9][0-9]*!)?(0|[1-9][0-9]*)(\.(0|[1-9][0-9]*))*((a|b|rc)(0|[1-9][0-9]*))?"
                               r"(\.post(0|[1-9][0-9]*))?(\.dev(0|[1-9][0-9]*))?")

SHOWN_MAX = 120  # characters of a refused value quoted in the message


class Refused(HostFailed):
    """A path, version or text from a host that fleetctl will not use on the control node.
    In a host's job, that host fails with the message (no traceback); the message quotes the
    value (repr: escapes shown) and says why."""


def _refuse(what: str, value: object, why: str) -> Refused:
    shown = repr(value[:SHOWN_MAX]) + "..." if isinstance(value, str) and len(value) > SHOWN_MAX else repr(value)
    return Refused(f"refused {what} from the host: {shown} ({why})")


def printable(text: object, what: str) -> str:
    """`text` unchanged when it is a str of printable characters only (str.isprintable: no
    control, format or line-break character; the space is printable). `what` names it in the
    message ("an install id"). Raises Refused: "... (holds the character U+000A)"."""
    if not isinstance(text, str):
        raise _refuse(what, text, "not a string")
    bad = next((c for c in text if not c.isprintable()), None)
    if bad is not None:
        raise _refuse(what, text, f"holds the character U+{ord(bad):04X}")
    return text


def package_file(rel: object) -> str:
    """`rel`, a file a host named relative to its install's location, unchanged when it is one:
    printable (see printable), relative with no `..` component, under sglang/, normalised
    (posixpath.normpath leaves it as it is). Raises Refused, e.g. "refused a path from the host:
    '../x' (not relative to the install)"."""
    printable(rel, "a path")
    if rel.startswith("/") or ".." in rel.split("/"):
        raise _refuse("a path", rel, "not relative to the install")
    if not rel.startswith(PACKAGE):
        raise _refuse("a path", rel, f"not under {PACKAGE}")
    if posixpath.normpath(rel) != rel:
        raise _refuse("a path", rel, "not a normalised path")
    return rel


def release(version: object) -> str:
    """`version` unchanged when it is a PEP 440 public version in canonical form ("0.5.23",
    "0.4.6.post5", "0.5.0rc2"). Raises Refused: "refused a version from the host: '0.5.*' (not a
    PEP 440 public version in canonical form)"."""
    if not isinstance(version, str) or not CANONICAL_VERSION.fullmatch(version):
        raise _refuse("a version", version, "not a PEP 440 public version in canonical form")
    return version
