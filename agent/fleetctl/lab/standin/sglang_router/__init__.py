"""fleetctl STAND-IN for the `sglang_router` package (not SGLang's router): see launch_server."""
