"""Whether root may run an interpreter, asked before fleetctl runs anything with it (review M6).

Runs under the host's python3 on PATH (root's own), never under the interpreter it judges,
whose `.pth` files would already have run. Stdlib only; the check itself is facts.untrusted,
loaded before this module by the probe bundle.
"""

if __package__:  # imported from the fleetctl package
    from . import facts
else:
    import facts  # loaded before this module by the probe bundle


def main(params):
    """params: {python: path}. Returns {"python": path, "untrusted": reason or None}."""
    return {"python": params["python"], "untrusted": facts.untrusted(params["python"])}
