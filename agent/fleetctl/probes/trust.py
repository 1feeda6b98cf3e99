"""Whether root may run an interpreter, asked before fleetctl runs anything with it (review M6).

Runs under the host's python3 on PATH (root's own), never under the interpreter it judges,
whose `.pth` files would already have run. Stdlib only; the check itself is facts.untrusted
(the bundle is facts' with this module last, probes.modules_for).
"""

from . import facts


def main(params):
    """params: {python: path}. Returns {"python": path, "untrusted": reason or None}."""
    return {"python": params["python"], "untrusted": facts.untrusted(params["python"])}
