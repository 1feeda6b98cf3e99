"""`python -m fleetctl`: the same as the `fleetctl` command."""

from .cli import main

main()
