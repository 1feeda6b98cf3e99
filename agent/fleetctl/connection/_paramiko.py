"""paramiko, imported without invoke.

paramiko.config imports invoke when it is installed (Fabric brings it), only for ssh_config's
`Match exec` (paramiko/config.py: `try: import invoke except ImportError`). fleetctl never reads
ssh_config with paramiko (OpenSSH's own `ssh -G` resolves it, resolve.py), and that import
(invoke, unittest.mock, asyncio) was 78 ms of every command's start, a quarter of paramiko's
(`python -X importtime`, bench/results/NOTES.md). While paramiko loads, `invoke` is marked
missing in sys.modules (the import system's own "not importable" entry); afterwards the mark is
removed, so invoke stays importable for anything else in the process.
"""

import sys

_MARKED = "invoke" not in sys.modules
if _MARKED:
    sys.modules["invoke"] = None  # type: ignore[assignment]
try:
    import paramiko  # noqa: E402
finally:
    if _MARKED:
        del sys.modules["invoke"]

__all__ = ["paramiko"]
