"""One table of the numbers and names fleetctl runs by: port, paths, deadlines, inventory vars,
connection kinds.

Nothing else in the control side spells these. The host-side probes keep their own copies of
the few they need (`probes/ledger.STATE_DIR`, `probes/procs.DEFAULT_PORT`); tests/unit/test_engine.py
checks they agree. The lab and the SGLang stand-in (`lab/`, `lab/standin/`) use 30000 as the
stand-in server's own default, as SGLang does.
"""

from __future__ import annotations

from dataclasses import dataclass

# SGLang's ServerArgs.port default (sglang/srt/server_args.py): used for a discovered server
# started without --port, and as the default of --port.
DEFAULT_SGLANG_PORT = 30000
# Where each host keeps fleetctl's state: ledger.jsonl, backups/, kernels/ (private builds), the lock.
STATE_DIR = "/var/lib/fleetctl"
# Where each host keeps the published kernel builds the server process reads (root, 0755):
# NAME/<key>/{src,build,PASSED}, NAME/current -> <key>, NAME/dispatch.json, route-evidence/<uid>/ (root 0755;
# each <uid>/ that uid's: probes/evidence.py).
# probes/change/actions.py, probes/facts/verifyroute.py keep copies (PUBLIC_DIR); tests check they agree.
PUBLIC_KERNELS_DIR = "/var/lib/fleetctl-kernels"

# ---- deadlines (seconds) ----------------------------------------------------------------
# the lock command's start on the host (session, sudo, mkdir, `flock -n`) until its marker line
# says it holds it: a loaded host's sshd and shell can take seconds; another run's lock fails at
# once, not after this
LOCK_START_S = 30.0
ROLLBACK_RESERVE_S = 120.0   # kept from a host's deadline for rolling a change back
LOCK_HOLD_EXTRA_S = 60.0     # the lock outlives the job's deadline + reserve by this much
CHECK_TIMEOUT_S = 120.0      # per-host deadline of a check pass (no restarts, no health waits)
HEALTH_TIMEOUT_S = 600.0     # default wait for /health to answer 200
REQUEST_TIMEOUT_S = 60.0     # one smoke /generate request
BUILD_DEADLINE_S = 1800.0    # one kernel build on a host
TEST_DEADLINE_S = 600.0      # one kernel reference test on a host
PROBE_SLACK_S = 60.0         # a probe's SSH deadline beyond the deadline it enforces itself
CONNECT_TIMEOUT_S = 10.0     # TCP connect, banner, key exchange and auth
INSPECT_TIMEOUT_S = 60.0     # per-host deadline of inspect
STATUS_TIMEOUT_S = 120.0     # per-host deadline of status
ROLLBACK_TIMEOUT_S = 300.0   # per-host deadline of rollback
ANSIBLE_INVENTORY_TIMEOUT_S = 120.0  # `ansible-inventory --list` of a non-YAML source (scripts, cloud plugins)


def smoke_job_timeout(health_timeout: float) -> float:
    """Default per-host deadline (s) of validate and apply: the health wait + 300 s."""
    return health_timeout + 300.0


def deploy_job_timeout(build_timeout: float, health_timeout: float) -> float:
    """Default per-host deadline (s) of a kernel deploy: build + health wait + 900 s (upload, test)."""
    return build_timeout + health_timeout + 900.0


# ---- inventory vars fleetctl reads ---------------------------------------------------------

@dataclass(frozen=True)
class HostVar:
    """One inventory var fleetctl reads: its name, its type (str, "port", "args": a command-line
    fragment split as a shell would, float or bool) and meaning; `aliases`: the other names
    Ansible reads it by, the last of `names` set winning (ansible/config/manager.py, _loop_entries)."""

    name: str
    type: object
    description: str
    aliases: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """name, then aliases: the order in which a later one set wins."""
        return (self.name, *self.aliases)


PYTHON = HostVar("fleetctl_python", str, "interpreter that runs SGLang (after ansible_python_interpreter)")
RESTART_CMD = HostVar("fleetctl_restart_cmd", str, "shell command that restarts SGLang (the restart handler)")
SGLANG_PORT = HostVar("fleetctl_sglang_port", "port", "port of the server the smoke decode talks to")
SGLANG_HOST = HostVar("fleetctl_sglang_host", str, "address of that server on the host (default 127.0.0.1)")
SMOKE_CMD = HostVar("fleetctl_smoke_cmd", str, "an offline smoke command, run on the host")
LATENCY_SLACK = HostVar("fleetctl_latency_slack", float, "seconds added to the latency gate's ratio")
SHARED_TREE = HostVar("fleetctl_shared_tree", bool, "the SGLang install is on a network file system other "
                      "hosts mount too, and changing it from this host is meant")

SGLANG_API_KEY = HostVar("fleetctl_sglang_api_key", str, "the server's --api-key, sent by the smoke decode as "
                         "Authorization: Bearer (never printed)")
CONTAINER_EXEC = HostVar("fleetctl_container_exec", str, "how to enter containers: docker, podman, crictl, "
                         "nsenter (fleetctl's entry, with the container process's uid, gid and no more "
                         "capabilities) or none (never); default: the runtime's CLI when on the host, else none")
UNPRIVILEGED_USER = HostVar("fleetctl_unprivileged_user", str, "the account an install's code runs as when no "
                            "server of it runs as another and root owns it (default nobody; never root)")

SERVER_USER = HostVar("fleetctl_server_user", str, "the account SGLang servers run as, when not root or a systemd "
                      "service (default: the owner of each server's interpreter environment); other processes "
                      "get no request and no API key")

PD_ROUTER = HostVar("fleetctl_pd_router", str, "http://ADDRESS:PORT of the PD router (prefill/decode "
                    "disaggregation) in front of this host's PD workers, on this host: the smoke decode goes through "
                    "it even when its process is not identified as one")

HOST_VARS = (PYTHON, RESTART_CMD, SGLANG_PORT, SGLANG_HOST, SMOKE_CMD, LATENCY_SLACK, SHARED_TREE, SGLANG_API_KEY,
             CONTAINER_EXEC, UNPRIVILEGED_USER, SERVER_USER, PD_ROUTER)
DEFAULT_SGLANG_HOST = "127.0.0.1"


# ---- connection kinds: how hosts are reached -------------------------------------------------

# The vars `ssh -G` is given for a host (connection/resolve.py, resolve_host), as Ansible's ssh and
# paramiko connections read them.
ADDRESS = HostVar("ansible_host", str, "where to connect (default: the inventory name)", ("ansible_ssh_host",))
PORT = HostVar("ansible_port", "port", "SSH port (default: ssh_config's)", ("ansible_ssh_port",))
USER = HostVar("ansible_user", str, "SSH user (default: ssh_config's)", ("ansible_ssh_user",))
KEY_FILE = HostVar("ansible_private_key_file", str, "SSH identity file, `~` expanded",
                   ("ansible_ssh_private_key_file",))
SSH_COMMON_ARGS = HostVar("ansible_ssh_common_args", "args", "extra arguments of every ssh, scp and sftp command "
                          "line (a bastion: `-o ProxyJump=...`, `-J`, `-F FILE`)")
SSH_EXTRA_ARGS = HostVar("ansible_ssh_extra_args", "args", "extra arguments of the ssh command line only")
SSH_VARS = (ADDRESS, PORT, USER, KEY_FILE, SSH_COMMON_ARGS, SSH_EXTRA_ARGS)


@dataclass(frozen=True)
class ConnectionKind:
    """One way of reaching hosts. `names`: the ansible_connection values that pick it (Ansible's
    names for it); `cls`: "module:Class" of the fleetctl.connection module that serves it (imported
    when a host needs it: a local-only run imports no paramiko); `vars`: the inventory vars it reads;
    `ssh`: its hosts are reached where OpenSSH's `ssh -G` resolves them (`fleetctl hosts` shows it)."""

    names: tuple[str, ...]
    cls: str
    vars: tuple[HostVar, ...]
    ssh: bool


# Every connection kind; adding one is a connection module and a row here. `ssh` and `smart` are
# Ansible's names for its OpenSSH connection, `paramiko_ssh` for its paramiko one.
CONNECTION_KINDS = (
    ConnectionKind(("paramiko", "paramiko_ssh"), "paramiko_ssh:ParamikoConnection", SSH_VARS, ssh=True),
    ConnectionKind(("ssh", "smart"), "openssh:OpenSSHConnection", SSH_VARS, ssh=True),
    ConnectionKind(("local",), "local:LocalConnection", (), ssh=False),
)
# ansible_connection values fleetctl reaches hosts with, each -> its kind (connection.session.Session.connect).
CONNECTIONS = {name: kind for kind in CONNECTION_KINDS for name in kind.names}
# every connection kind's vars, each once
CONNECTION_VARS = tuple(dict.fromkeys(v for kind in CONNECTION_KINDS for v in kind.vars))
