"""Kernel packages and their deployment: `package` (kernels/NAME/kernel.yaml, its sources and
build key), `deploy` (`fleetctl deploy kernel`: preflight, build, reference test, publish,
activation as a change), `dispatch` (the dispatch table: which shapes the hook routes),
`measure` (the measured table on a GPU host). Imports the change engine and the gates; nothing
in engine/ above the job runtime imports it."""
