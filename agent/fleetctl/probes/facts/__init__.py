"""Facts: what a host has (processes and servers, installs, GPUs, torch, units, containers,
the allocator call sites, RECORD drift, the scan cache), read without changing anything."""
