"""Where a host really is, as OpenSSH decides it: `ssh -G`, or a strict fallback reader.

`ssh -G` (ssh(1)) prints the configuration OpenSSH would use for a destination after evaluating
the whole ssh_config (Include, Match, Host, tokens, CanonicalizeHostname) and exits without
connecting. fleetctl runs the command line Ansible's ssh connection builds
(`ssh -G [common args] [-F file] [-o User=] [-o Port=] [-o IdentityFile=] ADDRESS`; OpenSSH keeps
the first value it obtains, so the inventory's values win) once per host and hop per run, in the
worker thread, under the connect deadline (`Match exec` runs commands). It tells where and how a
host is reached, and what its config asks of host keys; the connections then apply fleetctl's
own host-key policy (hostkey_policy.py), and an inventory whose args name where host keys are
looked up is refused before `ssh -G` runs.

`ssh -G` prints IdentityFile, CertificateFile, IdentityAgent and ProxyCommand unexpanded; they are
expanded here with ssh_config(5)'s TOKENS (`%C` is OpenSSH's own: the command line asks for
`ControlPath=%C`, which `ssh -G` prints expanded). Identity and certificate files that do not exist
are skipped, as ssh does.

Without an OpenSSH client, `fallback_options` reads the ssh_config files itself and refuses
(exit 4, file:line) what only OpenSSH can evaluate: Include, Match, tokens it cannot expand,
ProxyJump chains.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import SshConfigError
from .errors import Unreachable
from .hostkey_policy import refuse_sources

# Bytes of `ssh -G` output read at most (its whole configuration is a few KiB).
SSH_G_MAX = 1 << 20
# ProxyJump hops followed at most (OpenSSH itself would recurse until it runs out of processes).
MAX_HOPS = 8
# Identity files ssh tries when the configuration names none (ssh_config(5), IdentityFile).
DEFAULT_IDENTITY_FILES = ("~/.ssh/id_rsa", "~/.ssh/id_ecdsa", "~/.ssh/id_ecdsa_sk", "~/.ssh/id_ed25519",
                          "~/.ssh/id_ed25519_sk", "~/.ssh/id_xmss", "~/.ssh/id_dsa")
# The values `ssh -G` prints when nothing sets them (OpenSSH 9.2, readconf.c fill_default_options);
# the fallback reader starts from these.
_DEFAULTS = {
    "port": ["22"], "userknownhostsfile": ["~/.ssh/known_hosts ~/.ssh/known_hosts2"],
    "globalknownhostsfile": ["/etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2"],
    "stricthostkeychecking": ["ask"], "hashknownhosts": ["no"], "identitiesonly": ["no"],
    "serveraliveinterval": ["0"], "serveralivecountmax": ["3"], "connecttimeout": ["none"],
}
# Options that change what the connection is, which the paramiko connection cannot do, with the
# value `ssh -G` prints when they are off (an option absent from `ssh -G` output is off too).
# Authentication methods ssh would try before public keys and fall back from (GSSAPIAuthentication,
# which Debian's /etc/ssh/ssh_config turns on; HostbasedAuthentication) are not among them:
# paramiko offers only the public keys.
UNSUPPORTED_BY_PARAMIKO = {
    "pkcs11provider": "none", "localforward": None, "remoteforward": None, "dynamicforward": None,
    "remotecommand": None, "forwardagent": "no", "forwardx11": "no", "tunnel": "false",
    "permitlocalcommand": "no", "proxyusefdpass": "no", "knownhostscommand": None, "revokedhostkeys": None,
    "verifyhostkeydns": "false", "bindaddress": None, "bindinterface": None, "sessiontype": "default",
}
_TOKEN = re.compile(r"%(.?)", re.DOTALL)
_EXPANSION = re.compile(r"%(.?)|\$\{([^}]*)\}", re.DOTALL)  # a token, or ${VAR}
# The tokens expand() knows (ssh_config(5), TOKENS), and the keywords whose values take them.
EXPANDED_TOKENS = "%CdhijkLlnpru"
_TOKEN_KEYWORDS = ("identityfile", "certificatefile", "userknownhostsfile", "identityagent", "controlpath")


@dataclass(frozen=True)
class Hop:
    """One ProxyJump hop as written: `[user@]host[:port]` or `ssh://[user@]host[:port]`."""

    host: str
    user: str | None = None
    port: int | None = None

    @classmethod
    def parse(cls, spec: str, where: str) -> "Hop":
        """Parse one hop (ssh(1) -J, ssh_config(5) ProxyJump). Raises SshConfigError naming `where`."""
        s = spec[len("ssh://"):] if spec.startswith("ssh://") else spec
        user, _, rest = s.rpartition("@")
        m = re.fullmatch(r"\[([^\]/]+)\](?::(\d+))?|([^:\[\]/]+)(?::(\d+))?", rest)
        if not m:
            raise SshConfigError(f"{where}: ProxyJump hop {spec!r} is not [user@]host[:port]")
        port = m[2] or m[4]
        if port is not None and not 0 < int(port) < 65536:
            raise SshConfigError(f"{where}: ProxyJump hop {spec!r}: port {port} out of range")
        return cls(m[1] or m[3], user or None, int(port) if port else None)

    def __str__(self) -> str:
        return (f"{self.user}@" if self.user else "") + self.host + (f":{self.port}" if self.port else "")


@dataclass(frozen=True)
class Resolved:
    """What OpenSSH would use to reach one destination (`name`, the argument given to ssh).

    hostname/port/user: where and as whom to connect. identity_files / certificate_files: existing
    files, expanded, in ssh's order. identity_agent: the agent socket path, None for none.
    proxy_jump: the hops in the order written (client -> first -> ... -> this host); each hop's
    own resolution is in `hops`. proxy_command: expanded, None for none. known_hosts: the
    UserKnownHostsFile entries ([] for `none`), then global_known_hosts (read-only pins).
    connect_timeout: seconds or None. server_alive_interval (seconds, 0: not set) /
    server_alive_count_max. options: everything `ssh -G` printed (lower-case keyword -> values).
    missing_identity_files: the identity files named (by the inventory or ssh_config, not
    OpenSSH's defaults) that do not exist, expanded, in ssh's order.
    """

    name: str
    hostname: str
    port: int
    user: str
    identity_files: tuple[Path, ...]
    certificate_files: tuple[Path, ...]
    identities_only: bool
    identity_agent: str | None
    proxy_jump: tuple[Hop, ...]
    proxy_command: str | None
    host_key_alias: str | None
    known_hosts: tuple[Path, ...]
    global_known_hosts: tuple[Path, ...]
    strict_host_key_checking: str
    hash_known_hosts: bool
    connect_timeout: float | None
    server_alive_interval: float
    server_alive_count_max: int
    options: dict[str, list[str]] = field(repr=False, compare=False)
    hops: tuple["Resolved", ...] = ()
    missing_identity_files: tuple[Path, ...] = ()

    @property
    def host_key_name(self) -> str:
        """The name OpenSSH looks the host key up by: HostKeyAlias, else `host` on port 22, else
        `[host]:port` (sshd(8), SSH_KNOWN_HOSTS FILE FORMAT)."""
        if self.host_key_alias:
            return self.host_key_alias
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"

    @property
    def host_key_checking_off(self) -> bool:
        """Whether the config or the inventory's args say StrictHostKeyChecking no/off (`ssh -G`
        prints `false`), which fleetctl treats as accept-new: never weaker (hostkey_policy)."""
        return self.strict_host_key_checking in ("no", "off", "false")

    def unsupported_by_paramiko(self) -> list[str]:
        """The options set here that the paramiko connection cannot honour, as `Keyword value`."""
        out = []
        for key, off in UNSUPPORTED_BY_PARAMIKO.items():
            out += [f"{key} {v}" for v in self.options.get(key, []) if off is None or str(v).lower() != off]
        return out


def passwd_home() -> Path:
    """The current user's home from the passwd database, as OpenSSH finds `~` (ssh(1): it never
    reads $HOME)."""
    return Path(pwd.getpwuid(os.getuid()).pw_dir)


def split_config_option(args: tuple[str, ...] | list[str]) -> tuple[list[str], Path | None]:
    """ssh command-line words without their `-F FILE` / `-FFILE`, and that file (the last one
    given, as ssh keeps, made absolute against the working directory), else None."""
    words, config, i = [], None, 0
    while i < len(args):
        if args[i] == "-F" and i + 1 < len(args):
            config, i = Path(args[i + 1]).absolute(), i + 2
            continue
        if args[i].startswith("-F") and len(args[i]) > 2:
            config = Path(args[i][2:]).absolute()
        else:
            words.append(args[i])
        i += 1
    return words, config


def ssh_g_argv(address: str, config_file: Path | None = None, user: str | None = None, port: int | None = None,
               identity_file: str | None = None, extra_args: tuple[str, ...] = ()) -> list[str]:
    """The `ssh -G` command line for `address`, as Ansible's ssh connection orders its options:
    `extra_args` (ansible_ssh_common_args / ansible_ssh_extra_args, already split into words),
    `-F config_file` unless those words give their own `-F` (a host's own config wins over
    --ssh-config: ssh would keep the last `-F`), then `-o User=` / `-o Port=` / `-o IdentityFile=`
    for the inventory's values, and `-o ControlPath=%C` so that OpenSSH prints its own %C hash."""
    argv = ["ssh", "-G", *extra_args]
    if config_file is not None and split_config_option(extra_args)[1] is None:
        argv += ["-F", str(config_file)]
    for key, value in (("User", user), ("Port", port), ("IdentityFile", identity_file)):
        if value is not None:
            argv += ["-o", f"{key}={value}"]
    return [*argv, "-o", "ControlPath=%C", "--", address]


def parse_ssh_g(text: str) -> dict[str, list[str]]:
    """`ssh -G` output (one `keyword value` a line) as keyword -> values in order."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if key:
            out.setdefault(key.lower(), []).append(value.strip())
    return out


def run_ssh_g(argv: list[str], deadline: float, what: str) -> dict[str, list[str]]:
    """Run `ssh -G` (argv from ssh_g_argv) in its own process group, killed at `deadline`
    (time.monotonic()). Raises SshConfigError with OpenSSH's message when it exits non-zero,
    Unreachable when it outlives the deadline (a `Match exec` that hangs)."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise Unreachable(f"{what}: `ssh -G` did not finish within the connect timeout "
                          "(a Match exec command, or DNS for CanonicalizeHostname)") from None
    if proc.returncode != 0:
        msg = err[-2000:].decode("utf-8", "replace").strip()
        raise SshConfigError(f"{what}: OpenSSH refuses its ssh_config (`ssh -G` exit {proc.returncode}): {msg}")
    return parse_ssh_g(out[:SSH_G_MAX].decode("utf-8", "replace"))


# ------------------------------------------------------------------ the fallback reader


def match_patterns(patterns: list[str], name: str, case_blind: bool = True) -> bool:
    """OpenSSH's pattern lists (ssh_config(5), PATTERNS): `*` and `?` wildcards, a matching
    `!pattern` refuses the name whatever else matches. `case_blind`: in ASCII only, as
    match_hostname's tolower() is (known_hosts; the Kelvin sign is no k); else case-sensitive, as
    readconf.c's match_pattern is for a `Host` line (OpenSSH 9.2: `Host alpha` does not apply to
    `ssh ALPHA`)."""
    flags = re.DOTALL | (re.IGNORECASE | re.ASCII if case_blind else 0)
    hit = False
    for p in patterns:
        neg = p.startswith("!")
        regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in (p[1:] if neg else p))
        if re.fullmatch(regex, name, flags):
            if neg:
                return False
            hit = True
    return hit


def _config_words(line: str) -> tuple[str, str] | None:
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    m = re.match(r"([^\s=]+)\s*(?:=\s*|\s+)(.*)", line)
    if not m:
        return line.lower(), ""
    value = m[2].strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    return m[1].lower(), value


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def fallback_options(address: str, files: list[Path], cli: dict[str, str]) -> dict[str, list[str]]:
    """What `ssh -G address` would print, read without OpenSSH from `files` (in order; missing
    ones skipped), after `cli` (keyword -> value, as `-o`): `Host` patterns matched against
    `address` as given, case-sensitively; the first value of an option wins, IdentityFile and
    CertificateFile accumulate without repeats (readconf.c add_identity_file); the HostName
    lowercased in ASCII, as ssh does. Values carry no expansion yet except HostName's %h.
    Raises SshConfigError with file:line for Include, Match, a ProxyJump chain, a HostName token
    other than %h and %%, a token expand() does not know in a keyword that takes tokens."""
    out: dict[str, list[str]] = {k.lower(): [v] for k, v in cli.items()}
    for path in files:
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except FileNotFoundError:
            continue
        except OSError as e:
            raise SshConfigError(f"{path}: cannot read ({e.strerror})") from None
        applies = True
        for lineno, line in enumerate(lines, start=1):
            words = _config_words(line)
            if words is None:
                continue
            key, value = words
            where = f"{path}:{lineno}"
            if key in ("include", "match"):
                raise SshConfigError(
                    f"{where}: {key.capitalize()} needs OpenSSH's own evaluation and no `ssh` client is on PATH: "
                    "install openssh-client (then fleetctl resolves hosts with `ssh -G`)")
            if key == "host":
                applies = match_patterns(value.split(), address, case_blind=False)
                continue
            if not applies:
                continue
            if key == "proxyjump" and "," in value:
                raise SshConfigError(f"{where}: a ProxyJump chain needs OpenSSH's own evaluation and no `ssh` "
                                     "client is on PATH: install openssh-client")
            if key == "hostname":
                bad = [t for t in _TOKEN.findall(value) if t not in ("h", "%")]
                if bad:
                    raise SshConfigError(f"{where}: HostName token %{bad[0]} cannot be expanded without OpenSSH")
                value = _TOKEN.sub(lambda m: address if m[1] == "h" else "%", value)
            bad = [t for t in _TOKEN.findall(value) if t not in EXPANDED_TOKENS]
            if key in _TOKEN_KEYWORDS and bad:
                raise SshConfigError(f"{where}: {key} token %{bad[0]} cannot be expanded without OpenSSH")
            if key in ("identityfile", "certificatefile"):
                if value not in out.setdefault(key, []):
                    out[key].append(value)
            else:
                out.setdefault(key, [value])
    out["hostname"] = [out.get("hostname", [address])[0].translate(_ASCII_LOWER)]
    out.setdefault("user", [pwd.getpwuid(os.getuid()).pw_name])
    out.setdefault("identityfile", list(DEFAULT_IDENTITY_FILES))
    for key, value in _DEFAULTS.items():
        out.setdefault(key, value)
    return out


# ------------------------------------------------------------------ expansion


def _tokens(name: str, options: dict[str, list[str]]) -> dict[str, str]:
    """ssh_config(5) TOKENS for a connection to `name` as configured by `options`."""
    first = {k: v[0] for k, v in options.items() if v}
    local = socket.gethostname()
    hostname, port, user = first["hostname"], first.get("port", "22"), first["user"]
    jump = first.get("proxyjump", "none")
    conn_hash = first.get("controlpath", "")
    if not re.fullmatch(r"[0-9a-f]{40}", conn_hash):  # the fallback reader: OpenSSH 9.2's %C
        conn_hash = hashlib.sha1(f"{local}{hostname}{port}{user}".encode()).hexdigest()
    return {"%": "%", "C": conn_hash, "d": str(passwd_home()), "h": hostname, "i": str(os.getuid()),
            "j": "" if jump == "none" else jump, "k": first.get("hostkeyalias", name), "L": local.split(".")[0],
            "l": local, "n": name, "p": port, "r": user, "u": pwd.getpwuid(os.getuid()).pw_name}


def expand(value: str, tokens: dict[str, str], what: str) -> str:
    """`value` with %-tokens and `${VAR}` environment variables replaced (one pass, as OpenSSH's
    percent_dollar_expand; ssh_config(5), ENVIRONMENT VARIABLES: `ssh -G` prints IdentityFile
    and CertificateFile with them unexpanded) and a leading `~` / `~user`
    expanded (passwd database, as ssh's tilde_expand). Raises SshConfigError naming `what` for a
    token OpenSSH does not define or a variable with no value."""
    def one(m: re.Match) -> str:
        if m[2] is not None:
            if m[2] not in os.environ:
                raise SshConfigError(f"{what}: {value!r}: environment variable ${{{m[2]}}} has no value")
            return os.environ[m[2]]
        if m[1] not in tokens:
            raise SshConfigError(f"{what}: {value!r}: unknown token %{m[1]}")
        return tokens[m[1]]

    value = _EXPANSION.sub(one, value)
    if value.startswith("~"):
        head, sep, tail = value[1:].partition("/")
        try:
            home = str(passwd_home()) if not head else pwd.getpwnam(head).pw_dir
        except KeyError:
            raise SshConfigError(f"{what}: {value!r}: no user {head!r} for ~") from None
        value = home + sep + tail
    return value


def resolved_from(name: str, options: dict[str, list[str]], what: str) -> Resolved:
    """A Resolved from `ssh -G`-shaped `options` for destination `name`; `what` names the host in
    errors. Raises SshConfigError for a value that cannot be expanded or parsed."""
    tok = _tokens(name, options)
    first = {k: v[0] for k, v in options.items() if v}

    def files(key: str) -> tuple[Path, ...]:
        paths = [Path(expand(v, tok, f"{what}: {key}")) for v in options.get(key, []) if v.lower() != "none"]
        return tuple(p for p in paths if p.is_file())

    def path_list(key: str) -> tuple[Path, ...]:
        value = first.get(key, "none")
        return () if value.lower() == "none" else tuple(Path(expand(v, tok, f"{what}: {key}")) for v in value.split())

    defaults = {Path(os.path.expanduser(p)) for p in DEFAULT_IDENTITY_FILES} | {
        Path(expand(p, tok, what)) for p in DEFAULT_IDENTITY_FILES}
    named = [Path(expand(v, tok, f"{what}: identityfile")) for v in options.get("identityfile", [])
             if v.lower() != "none"]
    missing = tuple(p for p in named if not p.is_file() and p not in defaults)
    agent = first.get("identityagent", "SSH_AUTH_SOCK")
    if agent.lower() == "none":
        agent = None
    elif agent.startswith("$") or agent == "SSH_AUTH_SOCK":
        agent = os.environ.get(agent.lstrip("$")) or None
    else:
        agent = expand(agent, tok, f"{what}: identityagent")
    jump = first.get("proxyjump", "none")
    hops = () if jump.lower() == "none" else tuple(Hop.parse(h, f"{what}: proxyjump") for h in jump.split(","))
    proxy_command = first.get("proxycommand", "none")
    proxy_command = None if proxy_command.lower() == "none" else _TOKEN.sub(
        lambda m: {"%": "%", "h": tok["h"], "n": tok["n"], "p": tok["p"], "r": tok["r"]}.get(m[1], m[0]),
        proxy_command)
    timeout = first.get("connecttimeout", "none")
    try:
        return Resolved(
            name=name, hostname=first["hostname"], port=int(first.get("port", "22")), user=first["user"],
            identity_files=files("identityfile"), certificate_files=files("certificatefile"),
            identities_only=first.get("identitiesonly", "no").lower() == "yes", identity_agent=agent,
            proxy_jump=hops, proxy_command=proxy_command,
            host_key_alias=first.get("hostkeyalias") if first.get("hostkeyalias", "none").lower() != "none" else None,
            known_hosts=path_list("userknownhostsfile"), global_known_hosts=path_list("globalknownhostsfile"),
            strict_host_key_checking=first.get("stricthostkeychecking", "ask").lower(),
            hash_known_hosts=first.get("hashknownhosts", "no").lower() == "yes",
            connect_timeout=None if timeout.lower() == "none" else float(timeout),
            server_alive_interval=float(first.get("serveraliveinterval", "0")),
            server_alive_count_max=int(first.get("serveralivecountmax", "3")),
            options=options, missing_identity_files=missing)
    except (KeyError, ValueError) as e:
        raise SshConfigError(f"{what}: cannot read the resolved ssh_config ({type(e).__name__}: {e})") from None


# ------------------------------------------------------------------ per run


class Resolver:
    """Resolutions of one run: each distinct `ssh -G` command line runs once (a bastion shared by
    every host is resolved once), whichever worker thread asks first; `Match exec` commands run
    once per host per run.

    config_file: `-F` (None: the user's ~/.ssh/config and /etc/ssh/ssh_config)."""

    def __init__(self, config_file: Path | None = None):
        self.config_file = config_file
        self._done: dict[tuple, Resolved] = {}
        self._lock = threading.Lock()
        self._locks: dict[tuple, threading.Lock] = {}

    def _files(self) -> list[Path]:
        if self.config_file is not None:
            return [self.config_file]
        return [passwd_home() / ".ssh" / "config", Path("/etc/ssh/ssh_config")]

    def resolve_host(self, host, deadline: float) -> Resolved:
        """How OpenSSH reaches inventory `host`: `ssh -G` for ansible_host (else its name) with
        ansible_ssh_common_args and ansible_ssh_extra_args first, then ansible_user / ansible_port /
        ansible_ssh_private_key_file as `-o` options (see resolve). Raises SshConfigError (exit 4)
        first, before any `ssh -G`, when those args name where host keys are looked up
        (hostkey_policy.refuse_sources: fleetctl takes that only from ssh_config)."""
        refuse_sources(host)
        return self.resolve(host.address, deadline, host.name, host.user, host.port, host.key_file,
                            host.ssh_common_args + host.ssh_extra_args)

    def resolve(self, address: str, deadline: float, what: str, user: str | None = None, port: int | None = None,
                identity_file: str | None = None, extra_args: tuple[str, ...] = ()) -> Resolved:
        """How OpenSSH reaches `address` (with the inventory's user, port and key file, when set;
        `extra_args`: words put first on the command line, Ansible's ansible_ssh_common_args and
        ansible_ssh_extra_args; not given to the hops' resolution, as ssh does not),
        every ProxyJump hop resolved too (a hop's own ProxyJump is followed only for the first
        hop, as ssh's `-J` does). `deadline` is a time.monotonic() value; `what` names the host in
        errors. Raises SshConfigError (exit 4), Unreachable (past the deadline)."""
        return self._resolve(address, deadline, what, user, port, identity_file, tuple(extra_args), ())

    def _resolve(self, address, deadline, what, user, port, identity_file, extra_args, path: tuple) -> Resolved:
        """`path`: the destinations whose resolution asked for this one (a loop is refused, as
        ssh's "jumphost loop")."""
        argv = ssh_g_argv(address, self.config_file, user, port, identity_file, extra_args)
        key = tuple(argv)
        here = (f"{user}@" if user else "") + address + (f":{port}" if port else "")
        if key in (k for k, _ in path):
            raise SshConfigError(f"{path[0][1]}: ProxyJump loop: {' -> '.join(n for _, n in path)} -> {here}")
        if len(path) > MAX_HOPS:
            raise SshConfigError(f"{path[0][1]}: more than {MAX_HOPS} ProxyJump hops")
        path = (*path, (key, here))
        with self._lock:
            lock = self._locks.setdefault(key, threading.Lock())
        if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise Unreachable(f"{what}: ssh_config not resolved within the connect timeout")
        try:
            if key not in self._done:
                self._done[key] = self._resolve_new(argv, address, deadline, what, user, port, identity_file,
                                                    extra_args, path)
            return self._done[key]
        finally:
            lock.release()

    def _resolve_new(self, argv, address, deadline, what, user, port, identity_file, extra_args, path) -> Resolved:
        if shutil.which("ssh"):
            options = run_ssh_g(argv, deadline, what)
        elif extra_args:
            raise SshConfigError(f"{what}: ansible_ssh_common_args / ansible_ssh_extra_args ({shlex.join(extra_args)}) "
                                 "need the OpenSSH client to be read (ssh -G): install openssh-client")
        else:
            cli = {k: str(v) for k, v in (("User", user), ("Port", port), ("IdentityFile", identity_file)) if v}
            options = fallback_options(address, self._files(), cli)
        r = resolved_from(address, options, what)
        hops: list[Resolved] = []
        for i, hop in enumerate(r.proxy_jump):
            # a hop is resolved from the config alone: ssh's ProxyJump hands its own ssh only -l, -p
            # and -F, never the command line's other options (ssh.c, ProxyJump to ProxyCommand)
            h = self._resolve(hop.host, deadline, f"{what} (ProxyJump hop {hop})", hop.user, hop.port, None,
                              (), path)
            if i > 0 and h.proxy_jump:  # ssh -J a,b: b is reached through a, whatever b's own ProxyJump says
                h = replace(h, proxy_jump=(), hops=())
            hops.append(h)
        if r.proxy_jump and r.proxy_command:
            raise SshConfigError(f"{what}: both ProxyJump and ProxyCommand are set")
        return replace(r, hops=tuple(hops))


def hop_chain(r: Resolved) -> list[Resolved]:
    """Every host on the way to `r`, in the order they are dialled (client -> first ...), `r` last:
    the first hop's own chain first."""
    if not r.hops:
        return [r]
    return [*hop_chain(r.hops[0]), *r.hops[1:], r]
