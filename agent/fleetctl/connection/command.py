"""The one place a remote command line is assembled.

Every command fleetctl starts on a host is a list of words (argv), never a shell string with
values pasted in: values travel as separate words (or on stdin), so nothing a host or an
inventory says can be parsed as shell. `remote_argv` wraps each one in the deadline wrapper
(coreutils `timeout -k`, which runs the command in its own process group and kills that group at
the deadline, so the remote work dies even when fleetctl is gone) and, for a host with
ansible_become, in the become prefix (`become_argv`: sudo, outside the deadline wrapper, since a
non-root `timeout` could not kill root's command; the inventory's sudo program and options read by
`become_exe` and `sudo_flags`). A probe for an install in a container runs
inside it: `container_entry` is one more prefix, inside the deadline wrapper (the runtime's exec,
or nsenter, is what the wrapper kills), and the interpreter after it is executed directly
(distroless images have no `sh` or `timeout`). The few fixed scripts fleetctl needs
(upload, lock) live here as constants that take their values as positional parameters.
"""

from __future__ import annotations

import base64
import math
import os
import secrets
import shlex
from typing import Iterator

from .. import probes

# Seconds between the remote `timeout`'s SIGTERM and its SIGKILL.
KILL_AFTER_S = 2
# Exit status of coreutils `timeout` when the command ran past its deadline (124), or needed the
# follow-up SIGKILL (128 + 9) (coreutils manual, "timeout invocation").
TIMEOUT_EXITS = (124, 137)

# $1 destination path, $2 octal mode, $3 sha256 of stdin. Writes a private temp file beside the
# destination, checks its hash, then renames it into place; the temp file never outlives a failure.
_UPLOAD = (
    'set -e; mkdir -p -- "$(dirname -- "$1")"; umask 077; '
    't=$(mktemp -- "$1.fleetctl-XXXXXX"); trap \'rm -f -- "$t"\' EXIT; cat > "$t"; '
    'got=$(sha256sum < "$t"); [ "${got%% *}" = "$3" ] || { echo "upload damaged: sha256 ${got%% *}" >&2; exit 1; }; '
    'chmod "$2" "$t"; mv -f -- "$t" "$1"; trap - EXIT'
)

# $1 state dir, $2 who holds it, $3 seconds to hold it at most, $4 seconds without a heartbeat
# byte after which the controller counts as gone, $5 the holder (_HOLD), $6 this hold's token (hex).
# The state dir must be a directory (not a link) of this uid that group and others cannot write
# (else exit 3, nothing written in it); flock -n fails at once (exit 75) when another run holds it.
# A login that is not root is told to become root (runas.BECOME_FIX's words).
_LOCK = ('umask 077 && mkdir -p -m 700 -- "$1" && [ -n "$(find "$1" -maxdepth 0 -type d -user "$(id -u)" ! -perm /022)" ] '
         '|| { [ "$(id -u)" = 0 ] || h=" ($(id -un) is not root: set ansible_become: true for this host, and pass -K '
         'if sudo asks for a password)"; '
         'echo "fleetctl: the state dir $1 is not a directory of uid $(id -u) that only it can write$h: not locked" >&2; '
         'exit 3; }; exec flock -n -E 75 "$1/lock" sh -c "$5" "$1" "$2" "$3" "$4" "$6"')

# The lock's holder ($0 state dir, $1 who, $2 hold seconds, $3 heartbeat window seconds, $4 the
# hold's token): clears what earlier holds left, writes lock.owner and this hold's own
# registration file lock.groups.TOKEN (a first line, so a later append needs no new block; exit 4
# when the file system is full), prints the line lock_marker(TOKEN) (found by it, after whatever
# a login shell printed first), then reads one heartbeat byte at a time from stdin; EOF
# (released, or the controller's connection closed), no byte within the window (a silent
# controller: a cut link, a dead control node), or the hold time (CLOCK_BOOTTIME's /proc/uptime,
# never the wall clock) ends the hold. Then registration is closed (the file renamed under its
# .lock, so a command that starts later, of this run or of an earlier one, refuses to), and the
# run's commands that still run (pid and start time, read past the comm field's last ")": a
# reused pid is never hit) get SIGTERM on their process group, SIGKILL when any of it is left
# KILL_AFTER_S later (`kill -s SIG --`: dash's kill takes no `-SIG --`).
_HOLD = (
    'g="$0/lock.groups.$4"; rm -f -- "$0"/lock.groups.*; '
    'printf "%s since %s\\n" "$1" "$(date -u +%FT%TZ)" > "$0/lock.owner" && printf "# %s\\n" "$1" > "$g" '
    '|| { echo "fleetctl: cannot write in $0 (is its file system full?): not locked" >&2; exit 4; }; '
    'printf "fleetctl-locked-%s\\n" "$4"; '
    'st() { t=$(cat "/proc/$1/stat" 2>/dev/null) || return 0; t=${t##*) }; set -- $t; shift 19; echo "$1"; }; '
    'end=$(( $(cut -d. -f1 /proc/uptime) + $2 )); '
    'while now=$(cut -d. -f1 /proc/uptime); [ "$now" -lt "$end" ]; do w=$((end - now)); [ "$w" -lt "$3" ] || w=$3; '
    'b=$(timeout "$w" head -c 1) && [ -n "$b" ] || break; done; '
    'flock "$g.lock" mv -f -- "$g" "$g.end"; '
    'k=; while read -r p s; do '
    '[ "$p" != "#" ] && [ -n "$s" ] && [ "$(st "$p")" = "$s" ] && '
    '{ kill -s TERM -- "-$p" 2>/dev/null || kill -s TERM "$p" 2>/dev/null; k="$k $p"; }; '
    'done < "$g.end"; '
    f'[ -z "$k" ] || {{ i=0; while [ "$i" -lt {KILL_AFTER_S * 10} ]; do a=; '
    'for p in $k; do kill -s 0 -- "-$p" 2>/dev/null && a=1; done; [ -n "$a" ] || break; sleep 0.1; i=$((i + 1)); done; '
    'for p in $k; do kill -s KILL -- "-$p" 2>/dev/null; done; }; '
    'rm -f -- "$g.end" "$g.lock"'
)

# $1 the lock holder's lock.groups.TOKEN, then the command (under the deadline wrapper, which
# makes its own process group, with this shell's pid: exec). This shell's pid and start time
# (/proc/PID/stat field 22; its comm is "sh") are appended to $1 under $1.lock before the command
# starts, and only while that hold still takes them: else exit 125 and nothing started (the hold
# ended, or its file system is full).
_TIED = ('flock "$1.lock" sh -c \'[ -f "$0" ] || exit 3; printf "%s %s\\n" "$1" "$2" >> "$0" || exit 4\' '
         '"$1" "$$" "$(cut -d" " -f22 "/proc/$$/stat")"; r=$?; [ "$r" = 0 ] || { if [ "$r" = 4 ]; then '
         'echo "fleetctl: cannot register with the host lock (is the state dir\'s file system full?): not started" >&2; '
         'else echo "fleetctl: this run no longer holds the host lock: not started" >&2; fi; exit 125; }; shift; exec "$@"')


def remote_argv(argv: list[str], timeout: float, tied: str | None = None) -> tuple[list[str], int]:
    """(the argv to start over there, the whole seconds it may run): `argv` under the deadline
    wrapper `timeout -k KILL_AFTER_S T`, T = ceil(timeout), at least 1. `tied`: the lock.groups
    file of the lock this connection holds (lock_argv): the command is registered there, so the
    lock's holder stops it when the run's controller is gone (security review turn 3, L3)."""
    if not isinstance(argv, (list, tuple)) or not argv or not all(isinstance(a, str) for a in argv):
        raise TypeError(f"a remote command is a non-empty list of strings, not {argv!r}")
    limit = max(1, math.ceil(timeout))
    wrapped = ["timeout", "-k", str(KILL_AFTER_S), str(limit), *argv]
    return (["sh", "-c", _TIED, "fleetctl-tied", tied, *wrapped] if tied else wrapped), limit


# sudo's options (sudo 1.9's src/parse_args.c: its getopt string and long_opts): the short
# letters, each followed by ":" when it takes a value (the rest of the word or the next word) or
# "::" when it takes one only attached (-hHOST); and the long names, each with its letter and
# whether it takes a value (True: required, as `--name=V` or `--name V`; None: optional, only as
# `--name=V`; False: none).
_SUDO_GETOPT = "Aa:BbC:c:D:Eeg:Hh::iKklNnPp:R:r:SsT:t:U:u:Vv"
_SUDO_LONG = {
    "askpass": ("A", False), "auth-type": ("a", True), "background": ("b", False), "bell": ("B", False),
    "close-from": ("C", True), "login-class": ("c", True), "chdir": ("D", True), "preserve-env": ("E", None),
    "edit": ("e", False), "group": ("g", True), "set-home": ("H", False), "help": ("h", False),
    "host": ("host", True), "login": ("i", False), "remove-timestamp": ("K", False),
    "reset-timestamp": ("k", False), "list": ("l", False), "no-update": ("N", False),
    "non-interactive": ("n", False), "preserve-groups": ("P", False), "prompt": ("p", True),
    "chroot": ("R", True), "role": ("r", True), "stdin": ("S", False), "shell": ("s", False),
    "command-timeout": ("T", True), "type": ("t", True), "other-user": ("U", True), "user": ("u", True),
    "version": ("V", False), "validate": ("v", False),
}
# Options fleetctl does not pass to sudo, by letter, with the reason.
_SUDO_REFUSED = {
    "p": "fleetctl gives sudo its own prompt (-p MARKER): that marker is how it knows sudo asks for "
         "the password",
    "A": "sudo would ask an askpass helper instead of reading the password on stdin (-S), which fleetctl "
         "answers (and sudo refuses -A with -S)",
    "u": "fleetctl gives -u itself: set ansible_become_user instead",
    "b": "sudo would run the command in the background, and fleetctl needs its output and exit status",
    **{c: f"it is sudo's {m} mode, not a way to run a command" for c, m in
       (("e", "edit"), ("l", "list"), ("v", "validate"), ("V", "version"), ("h", "help"),
        ("K", "remove-timestamp"), ("U", "list (-U)"))},
}
# The options that make sudo run the command through a shell, which parses it again: -i (the
# become user's login shell) and -s ($SHELL). sudo joins the words after it into one `-c` string,
# each character but letters, digits, `_`, `-` and `$` after a backslash (parse_args.c, "quote
# potential meta characters"): `$` is expanded and a newline dropped by that shell.
_SUDO_SHELL = ("i", "s")

# Words fleetctl puts after sudo's `--`: `sh -c _READY READY ARGV...` prints READY and runs ARGV.
_READY = 'printf "%s\\n" "$0" >&2; exec "$@"'
# The same through a shell that parses the command again (_SUDO_SHELL): each word of ARGV travels
# as `b` and its base64 (letters, digits, +, / and =, which survive the backslashes; never empty,
# which that parse would drop), decoded here (coreutils base64) before READY; the script itself
# is decoded by a first one that holds no `$` and no newline, so the second parse gives both
# back unchanged.
_UNPACK = ('n=$#; for e; do a=$(printf %s "${e#b}" | base64 -d && echo .) || exit 126; '
           'set -- "$@" "${a%.}"; done; shift "$n"; ' + _READY)
_SHELL_BOOT = 'eval "`echo ' + base64.b64encode(_UNPACK.encode()).decode() + ' | base64 -d`"'

# Programs Ansible users name in ansible_become_exe that are not sudo, with why fleetctl cannot
# run them in sudo's place.
_NOT_SUDO = {
    "doas": "doas reads a password only from a terminal (it has no -S and no -p), and fleetctl never "
            "allocates one",
    "pbrun": "pbrun has no -S and no -p (it asks on a terminal); Ansible drives it with its own become "
             "method, pbrun, which fleetctl does not run",
    "dzdo": "dzdo is driven by Ansible's own become method (community.general.dzdo), not as sudo, and "
            "fleetctl runs sudo only",
    "su": "su takes none of sudo's options and asks on a terminal; Ansible's become method su, which "
          "fleetctl does not run, answers it on a pty",
}


def become_exe(value: str) -> str:
    """The sudo program of ansible_become_exe `value` (Ansible's sudo become plugin, become_exe;
    "" means sudo): an absolute path or a name the host's PATH finds, whose last part is `sudo`
    (a site's own sudo, or a wrapper that takes sudo's command line and prints -p's prompt).
    Raises ValueError saying why for another program (doas, pbrun, dzdo, su, ...: none takes
    sudo's `-S -p MARKER -u USER --`, which fleetctl's password handshake needs), options in
    the value, or a relative path."""
    words = shlex.split(value)
    if not words:
        return "sudo"
    if len(words) > 1:
        raise ValueError("it holds options: it names the sudo program only; put the options in "
                         "ansible_become_flags")
    exe = words[0]
    if "/" in exe and not exe.startswith("/"):
        raise ValueError("it is a relative path: give an absolute path, or a name the host's PATH finds")
    name = os.path.basename(exe)
    if name != "sudo":
        why = _NOT_SUDO.get(name, "fleetctl runs only sudo (its -S -p -u -- command line and its prompt on "
                                  "stderr): a site's own sudo, or a wrapper that behaves as sudo, is named "
                                  "by a path whose last part is `sudo`")
        raise ValueError(f"it is not sudo: {why}")
    return exe


def _sudo_long(word: str) -> tuple[str, str | None, str | None]:
    """(letter, full name, value after `=` or None) of the long option `word` ("--name[=V]"),
    its name resolved as getopt_long resolves it (the exact name, else the one name it is a
    prefix of); an unknown name gives letter "" and None. Raises ValueError for a prefix of
    several names."""
    name, eq, value = word[2:].partition("=")
    if name in _SUDO_LONG:
        return _SUDO_LONG[name][0], name, value if eq else None
    matches = [n for n in _SUDO_LONG if n.startswith(name)]
    if len(matches) > 1:
        raise ValueError(f"{word!r} is ambiguous: it may be --{', --'.join(matches)}")
    return (_SUDO_LONG[matches[0]][0], matches[0], value if eq else None) if matches else ("", name, None)


def _sudo_takes(letter: str) -> bool | None:
    """Whether short option `letter` takes a value: True required, None only attached, False none
    (also for a letter sudo does not know)."""
    at = _SUDO_GETOPT.find(letter) if letter != ":" else -1
    if at < 0:
        return False
    return None if _SUDO_GETOPT[at + 1:at + 3] == "::" else _SUDO_GETOPT[at + 1:at + 2] == ":"


def _sudo_options(words: tuple[str, ...]) -> Iterator[tuple[str, list[str]]]:
    """Each option in `words` as sudo reads its command line, as (its letter, the words that
    give it): short options one by one out of a group (`-Hn`: H, n), a value attached or the
    next word (`-gwheel`, `-g wheel`); long ones as _sudo_long reads them; `-hHOST`, `-h HOST`
    and `--host` as "host" (sudo takes a lone -h followed by a word that is not an option as the
    host, else it is the help); `--preserve-env=LIST` as "E=" (not -E); NAME=VALUE as "="; an
    unknown option as "" (long) or its letter (short, taking no value). Raises ValueError for
    `--`, a word that is neither (sudo would run it, and all after it, as the command), a
    missing value, or an ambiguous long name."""
    i = 0
    while i < len(words):
        word, i = words[i], i + 1
        if word == "--" or not word.startswith("-") or word == "-":
            if word != "--" and "=" in word and not word.startswith(("/", "=")):
                yield "=", [word]
                continue
            raise ValueError(f"{word!r} is not a sudo option: sudo would take it, and all after it, as the command")
        if word.startswith("--"):
            letter, name, value = _sudo_long(word)
            if letter and _SUDO_LONG[name][1] is True and value is None:
                if i == len(words):
                    raise ValueError(f"{word!r} needs a value")
                yield letter, [word, words[i]]
                i += 1
            else:
                yield ("E=" if letter == "E" and value is not None else letter), [word]
            continue
        j = 1
        while j < len(word):
            letter, value, j = word[j], word[j + 1:], j + 1
            takes = _sudo_takes(letter)
            if takes is False:
                yield letter, [f"-{letter}"]
                continue
            j = len(word)
            if letter == "h":
                lone_host = word == "-h" and i < len(words) and not words[i].startswith("-") and "=" not in words[i]
                if lone_host:
                    yield "host", ["-h", words[i]]
                    i += 1
                else:
                    yield ("host", [word]) if value else ("h", ["-h"])
            elif value or takes is None:
                yield letter, [f"-{letter}{value}"]
            elif i == len(words):
                raise ValueError(f"-{letter} needs a value")
            else:
                yield letter, [f"-{letter}", words[i]]
                i += 1


def sudo_flags(words: tuple[str, ...], password: bool) -> tuple[tuple[str, ...], bool]:
    """(the words to give sudo, whether they make it run the command through a shell) for
    ansible_become_flags `words` (split as a shell would), read as sudo reads its options
    (_sudo_options; each given back as its own word). As Ansible's sudo become plugin does, `-n`
    (non-interactive) is left out when a password is given (`password`), so that sudo can ask
    for it, and kept otherwise (sudo then fails at once where it would ask); options sudo does
    not know are passed through as Ansible passes them (sudo refuses them itself, with its usage
    message); -i and -s are run (become_argv quotes the command for the shell they start).
    Raises ValueError saying why for an option fleetctl does not pass (_SUDO_REFUSED: -p, -A,
    -u, -b, and the modes that run no command), for what _sudo_options refuses, and for -i with
    -s or -E (which sudo refuses)."""
    out: list[str] = []
    used: set[str] = set()
    for letter, given in _sudo_options(words):
        if letter in _SUDO_REFUSED:
            raise ValueError(f"{' '.join(given)}: {_SUDO_REFUSED[letter]}")
        used.add(letter)
        if not (letter == "n" and password):
            out += given
    if "i" in used and ("s" in used or "E" in used):
        raise ValueError(f"-i with {'-s' if 's' in used else '-E'}: sudo refuses the two together")
    return tuple(out), any(c in used for c in _SUDO_SHELL)


def become_argv(argv: list[str], user: str, flags: tuple[str, ...], prompt: str, ready: str,
                exe: str = "sudo", shell: bool = False) -> list[str]:
    """`argv` (already under the deadline wrapper) run by sudo as `user`: `EXE -S -p PROMPT FLAGS
    -u USER -- sh -c 'print READY on stderr; exec "$@"' READY ARGV...`. -S: sudo reads a password
    from stdin, never a tty (sudo(8)); -p: its prompt is PROMPT, written to stderr with no
    newline, so the caller sees whether sudo asks before anything reaches the command's stdin;
    READY on a line of its own on stderr says sudo let the command start. `exe` and `flags`:
    become_exe and sudo_flags of the inventory's values (sudo_flags refuses those that would
    undo -S, -p or -u); with `shell` (sudo_flags: -i or -s, whose shell parses the command again)
    the words after `sh -c` are _SHELL_BOOT, READY and ARGV base64-encoded (each after a `b`),
    which that second parse leaves as they are. `prompt` and `ready` are the caller's random
    markers (no `%`, which sudo's -p expands; letters, digits, `-` and `:` only, which no shell
    changes). Raises ValueError for a marker with `%`."""
    if "%" in prompt:
        raise ValueError("a sudo prompt marker must not hold %")
    head = [exe, "-S", "-p", prompt, *flags, "-u", user, "--", "sh", "-c"]
    if not shell:
        return [*head, _READY, ready, *argv]
    return [*head, _SHELL_BOOT, ready, *("b" + base64.b64encode(os.fsencode(a)).decode() for a in argv)]


# How a container is entered (inventory `fleetctl_container_exec`); "none": never.
CONTAINER_EXECS = ("docker", "podman", "crictl", "nsenter", "none")


def container_entry(how: str, container_id: str, pid: int, process: dict) -> list[str]:
    """The prefix that runs a command inside a container: `podman exec -i ID`, `docker exec -i
    ID`, `crictl exec -i ID` (the runtime applies the container's user, capabilities, cgroup,
    seccomp and LSM profile), or for "nsenter" fleetctl's entry program under the host's python3
    on PATH, cleared by trust.GUARD (probes.path_python; probes/enter.py: the namespaces and cgroups of the container's process `pid` as the host
    sees it, with that process's uid and gid, no capabilities beyond its bounding set and
    no_new_privs; `process`: {uid, gid, start_time} as probes/containers.process read them).
    Raises ValueError for another `how`, a container id that is not hex, or a process whose
    uid, gid or start time is unknown."""
    if how in ("podman", "docker", "crictl"):
        if not container_id or not all(c in "0123456789abcdef" for c in container_id):
            raise ValueError(f"container id {container_id!r} is not a hex id")
        return [how, "exec", "-i", container_id]
    if how == "nsenter":
        uid, gid, start = process.get("uid"), process.get("gid"), process.get("start_time")
        if not (isinstance(uid, int) and isinstance(gid, int) and isinstance(start, str) and start.isdigit()):
            raise ValueError(f"the uid, gid and start time of pid {pid} are unknown: not entered")
        return probes.path_python(["-c", probes.source("enter"), str(int(pid)), start, str(uid), str(gid), "--"])
    raise ValueError(f"no way to enter a container with {how!r} (one of {', '.join(CONTAINER_EXECS[:-1])})")


def python_lock_argv(python: str, state_dir: str, who: str, hold_s: int, beat_s: int, token: str) -> list[str]:
    """lock_argv for a place with Python and nothing else (a distroless container): the same
    protocol (STATE_DIR/lock held with flock; the line lock_marker(token) once held; exit 75, a
    line holder_marker(token) then the holder on stdout, when another run holds it; released at
    EOF on stdin, after `beat_s` seconds without a heartbeat byte, or after `hold_s` seconds).
    Commands in the container are not registered with it (they are started by the runtime's
    exec, whose client the host's deadline wrapper kills). Raises ValueError for a token that is
    not hex."""
    _check_token(token)
    return [python, "-I", "-c", _PY_LOCK, state_dir, who, str(hold_s), str(beat_s), lock_marker(token),
            holder_marker(token)]


_PY_LOCK = r"""
import fcntl, os, select, sys, time
d, who, hold, beat, locked, holder = sys.argv[1:7]
hold, beat = int(hold), int(beat)
os.umask(0o077)
os.makedirs(d, mode=0o700, exist_ok=True)
fd = os.open(os.path.join(d, "lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    sys.stdout.write(holder + "\n")
    try:
        o = os.open(os.path.join(d, "lock.owner"), os.O_RDONLY | os.O_NOFOLLOW)
        sys.stdout.write(os.read(o, 4096).decode("utf-8", "replace"))
    except OSError:
        pass
    sys.stdout.flush()
    sys.exit(75)
o = os.open(os.path.join(d, "lock.owner"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
os.write(o, ("%s since %s\n" % (who, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))).encode())
os.close(o)
print(locked, flush=True)
end = time.monotonic() + hold
while time.monotonic() < end:
    r, _, _ = select.select([0], [], [], max(0.0, min(beat, end - time.monotonic())))
    if not r or not os.read(0, 65536):
        break
"""


def shell_line(argv: list[str]) -> str:
    """`argv` as one POSIX shell line, each word quoted (for transports such as SSH's exec
    request that carry a string to the login shell)."""
    return shlex.join(argv)


# The line a command's exit status is reported on, at the end of its stderr (exit_status_line).
EXIT_LINE_PREFIX = b"\nfleetctl-exit:"


def exit_status_line(argv: list[str]) -> str:
    """`argv` as one shell line that ends its stderr with `\nfleetctl-exit:N\n` (N: its exit
    status) and exits with N: the status travels in-band, for a transport (the OpenSSH client)
    whose own failure status 255 a command could also return."""
    return shell_line(argv) + '; c=$?; printf \'\\nfleetctl-exit:%d\\n\' "$c" >&2; exit "$c"'


def operator_argv(cmd: str) -> list[str]:
    """An operator's own shell command (inventory `fleetctl_restart_cmd`, a playbook handler):
    run by `sh -c`, as written by the person who owns the host."""
    return ["sh", "-c", cmd]


def upload_argv(path: str, mode: int, sha256: str) -> list[str]:
    """The command that writes its stdin to `path` with `mode`, atomically, checked against
    `sha256` (hex)."""
    return ["sh", "-c", _UPLOAD, "fleetctl-upload", path, format(mode, "o"), sha256]


def lock_argv(state_dir: str, who: str, hold_s: int, beat_s: int, token: str) -> list[str]:
    """The command that holds STATE_DIR/lock for `hold_s` seconds at most, until its stdin
    closes, or until `beat_s` seconds pass without a heartbeat byte on it; it prints the line
    lock_marker(token) once held, exits 75 when another run holds it, 3 when the state dir is not this user's alone, 4
    when nothing can be written there. Commands started with remote_argv(tied=lock_groups(
    STATE_DIR, token)) while it holds are stopped (their process groups) when it ends. `token`:
    this hold's own (hex), so a command of an earlier hold never registers with a later one."""
    _check_token(token)
    return ["sh", "-c", _LOCK, "fleetctl-lock", state_dir, who, str(hold_s), str(beat_s), _HOLD, token]


def lock_groups(state_dir: str, token: str) -> str:
    """The file the hold `token` reads the run's commands from (remote_argv's `tied`)."""
    return f"{state_dir}/lock.groups.{token}"


def _check_token(token: str) -> None:
    """Raises ValueError unless `token` (a lock hold's) is lowercase hex."""
    if not token or not all(c in "0123456789abcdef" for c in token):
        raise ValueError(f"a lock token is hex, not {token!r}")


# What a reply marker is made of: `fleetctl-KIND-` and 16 random hex digits (reply_marker).
_MARKER_HEX = 8


def reply_marker(kind: str) -> str:
    """A marker for one call's reply, `fleetctl-KIND-<16 random hex digits>` (letters, digits and
    `-`: no shell changes it): what a login shell's startup file prints on stdout before the
    command (a banner from ~/.bashrc or ~/.profile, or the become user's with sudo -i) cannot
    hold it, so a reply is found by it, never by its place in stdout."""
    return f"fleetctl-{kind}-{secrets.token_hex(_MARKER_HEX)}"


def lock_marker(token: str) -> str:
    """The line the lock command prints once it holds the lock (lock_argv, python_lock_argv)."""
    return f"fleetctl-locked-{token}"


def holder_marker(token: str) -> str:
    """The line python_lock_argv prints before the holder, when another run holds the lock."""
    return f"fleetctl-holder-{token}"


def framed(argv: list[str], marker: str) -> list[str]:
    """`argv` run after a line MARKER on its stdout (`sh -c 'printf ...; exec "$@"'`, the marker
    a separate word): what it prints is found after that line (reply), whatever came before."""
    return ["sh", "-c", 'printf "%s\\n" "$0"; exec "$@"', marker, *argv]


def reply(stdout: bytes, marker: str) -> bytes | None:
    """What `stdout` holds after its first line that is `marker` (a reply_marker, lock_marker or
    holder_marker); None when no line is."""
    m = marker.encode()
    at = (b"\n" + stdout).find(b"\n" + m + b"\n")
    return None if at < 0 else stdout[at + len(m) + 1:]


def unframed(stdout: bytes, marker: str, limit: int = 200) -> str:
    """The error's words for a reply whose `marker` line never came: what stdout held instead (at
    most `limit` characters, escaped), and the usual cause."""
    said = stdout.decode("utf-8", "replace").strip()
    held = repr(said[:limit]) + ("..." if len(said) > limit else "") if said else "nothing"
    return (f"its stdout held {held}, and no line {marker}: the login shell of the SSH user (or the become "
            "user's, with become_flags -i or -s) did not run the command, or one of its startup files "
            "(~/.bashrc, ~/.profile, /etc/profile) ended or replaced it; what such a file prints before the "
            "command is fine")
