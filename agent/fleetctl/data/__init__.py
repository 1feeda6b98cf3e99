"""Data fleetctl ships: `playbooks/` and `kernels/` of the source tree, built into the wheel as
the package data of `fleetctl.data.playbooks` and `fleetctl.data.kernels` (see pyproject.toml).
Find them with fleetctl.paths, not by path."""
