"""The change actions on a host (apply, rollback, commit, recover, status) and their ledger."""
