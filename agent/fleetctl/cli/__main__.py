"""`python -m fleetctl.cli`: the same as the `fleetctl` command."""

from . import main

main()
