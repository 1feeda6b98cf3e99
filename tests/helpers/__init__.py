"""Helpers the test rooms share (unit, machine, fleet): processes and ports (proc), local hosts
and the lab's stand-in (lab), a host's ledger (ledger). conftest.py puts tests/ on sys.path, so a
test imports them as `from helpers.proc import alive`."""
