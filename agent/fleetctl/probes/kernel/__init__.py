"""Kernel builds on a host: state, preflight, build, reference test, publish, and the dispatch
bench on the host's GPU."""
