"""fleetctl's host-key policy, the same for both SSH connection kinds (ssh: openssh.py; paramiko:
paramiko_ssh.py and paramiko_dial.py) whatever the inventory says (security review turn 3, N3).

- Where host keys are looked up, and under which name, comes from ssh_config only (the user's,
  `--ssh-config FILE`, or a host's own `-F FILE`): inventory ssh args (ansible_ssh_common_args /
  ansible_ssh_extra_args) that set one of SOURCES are refused (`refuse_sources`, exit 4), so no
  inventory line can point a host at `/dev/null` or at a file of its own choosing.
- How strict: StrictHostKeyChecking yes, or accept-new with `--accept-new`. `no`/`off` from
  anywhere (ssh_config or the inventory's args: `ssh -G` reports the first value given) counts as
  accept-new, with a warning; a changed key is never accepted. accept-new needs a
  UserKnownHostsFile that keeps the key (not `none`, not /dev/null): with nowhere to keep it,
  accept-new would trust every host on every connect, so unknown keys are refused.
- The ssh kind puts the policy first on every `ssh` command line (`ssh_options`). OpenSSH keeps
  the first value it obtains for an option (ssh_config(5), DESCRIPTION; ssh(1), -o), so the
  inventory's args, which come after, cannot change it. paramiko applies the same decision
  (`accept_new`) in paramiko_dial.verifying_client.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from ..config import SSH_COMMON_ARGS, SSH_EXTRA_ARGS
from ..errors import SshConfigError

log = logging.getLogger("fleetctl")

# The ssh_config(5) options that say where host keys are looked up or by what name: fleetctl
# takes them only from ssh_config (lower-case keyword -> the manual's spelling).
SOURCES = {k.lower(): k for k in ("UserKnownHostsFile", "GlobalKnownHostsFile", "KnownHostsCommand",
                                  "HostKeyAlias", "CheckHostIP", "VerifyHostKeyDNS")}
# The inventory vars whose words go on ssh's command line (Ansible's ssh connection).
ARGS_VARS = (SSH_COMMON_ARGS.name, SSH_EXTRA_ARGS.name)
# ssh(1)'s options that take an argument (OpenSSH 9.2 ssh.c getopt string
# "1246ab:c:e:fgi:kl:m:no:p:qstvxAB:CD:E:F:GI:J:KL:MNO:P:Q:R:S:TVw:W:XYy").
_WITH_ARGUMENT = frozenset("bceilmopBDEFIJLOPQRSwW")
# A `-o` argument's keyword, as ssh_config(5) reads a line: up to whitespace or `=`, optionally
# in double quotes.
_KEYWORD = re.compile(r'\s*(?:"([^"]*)"|([^\s="]+))')


def dash_o_arguments(words: tuple[str, ...] | list[str]) -> list[str]:
    """The argument of every `-o` in ssh command-line `words`, in order, read as ssh's getopt
    reads them: `-o ARG`, `-oARG`, clustered flags (`-Cvo ARG`); the word after an option that
    takes an argument is that argument (`-i -oX` names a file); nothing after `--`."""
    out, i = [], 0
    while i < len(words):
        word, i = words[i], i + 1
        if word == "--":
            break
        if not word.startswith("-") or word == "-":
            continue  # a destination: ssh reads the options after it too
        for j in range(1, len(word)):
            if word[j] in _WITH_ARGUMENT:
                arg = word[j + 1:]
                if not arg and i < len(words):
                    arg, i = words[i], i + 1
                if word[j] == "o":
                    out.append(arg)
                break
    return out


def keyword(arg: str) -> str:
    """The ssh_config keyword of one `-o` argument (`Name=value`, `Name value`), lower-case."""
    m = _KEYWORD.match(arg)
    return (m[1] if m and m[1] is not None else m[2] if m else "").lower()


def refuse_sources(host) -> None:
    """Refuse an inventory `host` (inventory.Host) whose ansible_ssh_common_args or
    ansible_ssh_extra_args set one of SOURCES, in any spelling ssh accepts (dash_o_arguments,
    keywords in any case). Raises SshConfigError (exit 4) "FILE:LINE: host NAME: VAR sets
    Keyword (`-o ARG`): ..." with the fix (the file:line where VAR is set, host.where)."""
    for var in ARGS_VARS:
        words = host.ssh_common_args if var == ARGS_VARS[0] else host.ssh_extra_args
        for arg in dash_o_arguments(words):
            name = SOURCES.get(keyword(arg))
            if name is None:
                continue
            hint = (" An inventory written by `fleetctl inventory export` for ansible-playbook sets it: give "
                    "fleetctl the inventory it was exported from." if name == "UserKnownHostsFile" else "")
            raise SshConfigError(
                f"{host.where.get(var, 'the inventory')}: host {host.name}: {var} sets {name} (`-o {arg}`): "
                "fleetctl takes where host keys are looked up, and by what name, only from ssh_config, so that "
                f"no inventory line can change the keys a host is checked against. Remove it from {var} and, "
                "if it is wanted, put it in ssh_config (--ssh-config FILE, or the host's own `-F FILE`)." + hint)


def _keeps_keys(path: Path | None) -> bool:
    """Whether `path` (the first UserKnownHostsFile; None: `none`) can keep a stored key: a
    regular file, or none yet (created on first use); not /dev/null or another device."""
    return path is not None and (not path.exists() or path.is_file())


def accept_new(r, flag: bool, what: str | None = None) -> bool:
    """Whether an unknown host key of `r` (a resolve.Resolved, not imported here: resolve.py
    imports this module) is stored on first use (accept-new) rather than refused: with `flag`
    (--accept-new), or where `r` says StrictHostKeyChecking no/off (a warning naming `what`,
    default r.name); never where r's first UserKnownHostsFile keeps no key (`none`, /dev/null;
    a warning). A changed key is refused either way."""
    what = what or r.name
    accept = flag
    if r.host_key_checking_off:
        log.warning("fleetctl: %s: StrictHostKeyChecking no/off (ssh_config or the inventory's ssh args) is treated "
                    "as accept-new (a changed key is still refused)", what)
        accept = True
    first = r.known_hosts[0] if r.known_hosts else None
    if accept and not _keeps_keys(first):
        log.warning("fleetctl: %s: UserKnownHostsFile %s keeps no host key, so an unknown key is refused (accept-new "
                    "there would trust every host on every connect)", what, first or "none")
        accept = False
    return accept


def strictness(accept: bool) -> str:
    """The StrictHostKeyChecking value (ssh_config(5)) for the decision `accept` (accept_new)."""
    return "accept-new" if accept else "yes"


def ssh_options(r, flag: bool, what: str | None = None) -> list[str]:
    """fleetctl's host-key option for an `ssh` command line to `r`, to go first on it:
    ["-o", "StrictHostKeyChecking=accept-new" or "=yes"] (accept_new decides; `flag` is
    --accept-new, `what` names the host in its warnings)."""
    return ["-o", f"StrictHostKeyChecking={strictness(accept_new(r, flag, what))}"]
