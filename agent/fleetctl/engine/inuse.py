"""Fail closed on an install in use that nothing can validate.

The facts probe names, per install, the processes that use it without being a server fleetctl
identified (probes/facts/inuse.py: its interpreter, or its files open or mapped): an engine
embedded in another serving framework, a job a scheduler started, a launcher fleetctl does not
know. A change to such an install reaches them at their next start, and no decode of fleetctl's
went through it. So a change whose smoke gate has nothing to decode (no identified server, no
offline check) refuses the host when its install is in use (`refusal`), before anything is
written; `--no-validate` (ChangeOptions.no_validate) is the operator's explicit way through,
recorded in the result (NO_VALIDATE under "validation") and in the ledger (VALIDATION_SKIPPED).
"""

from __future__ import annotations

NO_VALIDATE = "by --no-validate"  # the skipped smoke gate's reason under --no-validate
VALIDATION_SKIPPED = "validation: skipped by --no-validate"  # the ledger's commit reason
SHOWN = 4  # processes named in a refusal (the facts carry up to probes/facts/inuse.MAX_PROCESSES)
CMDLINE_SHOWN = 200  # characters of a command line in a refusal
WHY = ("no SGLang server of this install was identified for them (fleetctl validates servers started by "
       "sglang.launch_server, `sglang serve` or sglang_router.launch_server), and no offline check "
       "(fleetctl_smoke_cmd) is set, so no decode would show the change works")


def escaped(text: object, limit: int = CMDLINE_SHOWN) -> str:
    """`text` (host data) as one bounded line: at most `limit` characters (then "..."), each
    character that is not printable (controls, line breaks, bidi and format characters) shown as
    its Python escape (\\x1b, \\n, \\u202e)."""
    s = "" if text is None else str(text)
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in s[:limit])
    return out + ("..." if len(s) > limit else "")


def _process(p: object) -> str:
    """One in_use process ({pid, uid, cmdline, why}: host data, hostile) as bounded, escaped
    text: "pid N (uid U; WHY): CMDLINE"."""
    if not isinstance(p, dict):
        return escaped(p)
    return f"pid {escaped(p.get('pid'), 20)} (uid {escaped(p.get('uid'), 20)}; {escaped(p.get('why'))}): " \
           f"{escaped(p.get('cmdline'))}"


def refusal(facts: dict, validated: bool) -> str | None:
    """Why a change to the install of `facts` (gather.install_facts: its "in_use", {"processes":
    [...], "more": N}) must not be written, or None: it is in use and not `validated` (the smoke
    gate armed: a server to decode or an offline check). The text names the install, each
    process (at most SHOWN, then how many more: pid, uid, command line, what ties it to the
    install), why they are not validated, and the way through (--no-validate). `validated`:
    the change's smoke gate is armed, or the install has a server identified (changes.execute)."""
    use = facts.get("in_use") or {}
    procs = use.get("processes") if isinstance(use, dict) else None
    if validated or not procs or not isinstance(procs, list):
        return None
    more = len(procs) - SHOWN + (use.get("more") if isinstance(use.get("more"), int) else 0)
    where = (facts.get("sglang") or {}).get("package_dir") or (facts.get("sglang") or {}).get("location") or "?"
    named = "; ".join(_process(p) for p in procs[:SHOWN]) + (f"; and {more} more" if more > 0 else "")
    return (f"not changed: install {escaped(where, 1000)} is in use by processes fleetctl cannot validate: "
            f"{named}; {WHY}. Stop them or give them a server fleetctl validates, or pass --no-validate to "
            f"change it without validation (recorded as such)")
