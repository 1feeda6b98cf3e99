"""A lab of real SSH hosts on this machine, for demos and fleet tests (`fleetctl lab`; its design
is lifecycle's docstring). The public API, from the lab's modules: base (names, paths, state),
lifecycle (up, down, status), faults, sshconfig, reach, become, layouts, container."""

from .base import DEFAULT_RELEASES, LATENCY_SLACK_S, PRIVATE_DIRS, VENV, LabError, inventory_path, state_dir_for
from .become import become_password, become_users
from .container import CONTAINER_IMAGE, CONTAINER_NAME, add_container_host, container_run_argv, podman_in
from .faults import lab_fault
from .layouts import CHECKOUT, SECOND_PORT, SECOND_STANDIN, add_install_layouts
from .lifecycle import host_pids, lab_down, lab_status, lab_up
from .reach import lab_add_reach_hosts
from .sshconfig import add_ssh_config_include, lab_ssh_config_path, remove_ssh_config_include, user_ssh_config

__all__ = ["DEFAULT_RELEASES", "LATENCY_SLACK_S", "PRIVATE_DIRS", "VENV", "LabError", "inventory_path",
           "state_dir_for", "become_password", "become_users", "CONTAINER_IMAGE", "CONTAINER_NAME",
           "add_container_host", "container_run_argv", "podman_in", "lab_fault", "CHECKOUT", "SECOND_PORT",
           "SECOND_STANDIN", "add_install_layouts", "host_pids", "lab_down", "lab_status", "lab_up",
           "lab_add_reach_hosts", "add_ssh_config_include", "lab_ssh_config_path", "remove_ssh_config_include",
           "user_ssh_config"]
