"""The Ansible front end: the collection fleetctl.sglang's build and planning, and the inventory export."""
