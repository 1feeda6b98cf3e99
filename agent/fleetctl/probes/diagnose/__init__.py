"""Diagnose: where a server's decode time goes. The host side (run: the private directory, the
profiler and expert-recorder endpoints, always stopped), the child that reads what the server
wrote as its uid (child), and the pure readers of a chrome trace (trace), of a recorder dump
(experts) and the kernel-name classes per release range (kernels)."""
