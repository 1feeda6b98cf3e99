"""The engine: what fleetctl does to a host, as jobs the fan-out runs (see README.md, Layout)."""
