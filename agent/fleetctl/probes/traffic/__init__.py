"""Traffic: requests to running SGLang servers (the smoke decode, the load client, the route
check, /server_info) and the allocator replay in a bounded child of an install's interpreter."""
