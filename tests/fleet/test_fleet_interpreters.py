"""Old interpreters and a hung container runtime, over real sshd on the lab (issue 31).

Case turn3/07: a host whose python3 first on PATH, or whose inventory interpreter (standing for
RHEL 8's /usr/libexec/platform-python), is Python 3.6 (pyenv's 3.6.15, which this machine kind's
image carries; no 3.6 comes from PyPI, Debian or npm) while the SGLang server runs from a 3.11
venv: inspect starts the probes under the server's own interpreter and reports its install;
`ansible_python_interpreter: /usr/bin/env python3` is accepted, resolved on the host and
trust-checked; 3.6 alone fails the host (exit 2) with one sentence, never a traceback. The 3.6 is
a link in the first directory of the PATH the login gives root (a root-owned tmpfs mounted there
in that lab host's own mount namespace only: nothing of the machine changes), as Debian's
/usr/bin/python3 links to python3.6.

A container runtime whose `podman exec` never answers: two containers on a lab host (root
processes in private mount namespaces in root-owned `libpod-<id>.scope` cgroups, which is what
makes them containers to fleetctl) and a root-owned stand-in `podman` first on PATH (named as one:
its `exec` hangs for one container and enters the other's mount namespace): the hung one costs
only its own install (not_inspected, with the reason and the seconds waited), the host's install
and the other container's are still reported, and the hung exec is killed on the host."""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import time

import pytest
import yaml

from conftest import missing

PY36 = "/root/.pyenv/versions/3.6.15/bin/python3.6"
RECORD = "/var/lib/fleetctl/scan-cache/interpreter"
SERVER_HOST = "lab-03"  # of server_lab: the stand-in server of SGLang 0.5.10 from /opt/sglang/venv (3.11)
ALONE_HOST = "lab-02"   # of lab: no server
RUNTIME_HOST = "lab-01"  # of lab: no server, the smallest release (0.4.6.post5): a short scan
SENTENCE = ("the probes need Python 3.8+; {old}, and no other trusted Python 3.8+ was found (a running SGLang "
            "server's, PATH's python3.8 to python3.14); set ansible_python_interpreter to a Python 3.8+ "
            "interpreter on this host")


def sh(lab, host: str, cmd: str, timeout: float = 60) -> str:
    r = lab.ssh(host, cmd, timeout=timeout)
    assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    return r.stdout


def pythons() -> None:
    """pyenv's 3.6.15 on this machine: missing, skipped, or failed with FLEETCTL_REQUIRE_LAB."""
    if not os.access(PY36, os.X_OK):
        missing(f"pyenv's {PY36} is not installed (this machine kind's image carries it)", "FLEETCTL_REQUIRE_LAB")


def inventory_with(lab, tmp_path, host: str, **host_vars) -> str:
    inv = yaml.safe_load(lab.inventory.read_text())
    inv["all"]["children"]["lab"]["hosts"][host].update(host_vars)
    path = tmp_path / f"hosts-{secrets.token_hex(3)}.yaml"
    path.write_text(yaml.safe_dump(inv))
    return str(path)


# where FirstOnPath mounts (the first directory of the login's PATH), the record's text, and the
# python* that hide_others covers, one a line; $1: "hide" or not, then name target pairs
_FIRST = r"""
hide=$1; shift
d=$(for p in $(echo "$PATH" | tr : " "); do [ -d "$p" ] && { echo "$p"; break; }; done)
[ -n "$d" ] || exit 1
echo "$d"; head -n 1 RECORD 2>/dev/null || echo
found=
if [ "$hide" = hide ]; then
  found=$(for p in $(echo "$PATH" | tr : " "); do [ "$p" = "$d" ] && continue
    for n in python python3 python3.8 python3.9 python3.10 python3.11 python3.12 python3.13 python3.14; do
      [ -f "$p/$n" ] && readlink -f "$p/$n"; done; done | sort -u)
fi
mount -t tmpfs -o mode=755 fc-interpreters "$d" && rm -f RECORD || exit 1
while [ $# -gt 1 ]; do ln -s "$2" "$d/$1" || exit 1; shift 2; done
: > "$d/.none" && chmod 644 "$d/.none"
for f in $found; do mount --bind "$d/.none" "$f" && echo "$f" || exit 1; done
""".replace("RECORD", RECORD)


class FirstOnPath:
    """A root-owned 0755 tmpfs mounted, in `host`'s own mount namespace, on the first directory of
    the PATH its login gives root (this machine's root .bashrc puts ~/.cargo/bin and pyenv's shims
    before /usr/local/sbin), holding `links` (name: target): what `command -v NAME` finds first
    there. `hide_others`: every python, python3 and python3.N (N >= 8) in the PATH's other
    directories is covered by an empty 0644 file (bind-mounted over it): not executable, so the
    probe's start (sh) does not find it. The host's record of the last probe's interpreter is
    removed (each case starts from PATH) and given back, and everything unmounted, by `undo`."""

    def __init__(self, lab, host: str, links: dict[str, str], hide_others: bool = False):
        self.lab, self.host = lab, host
        words = [w for pair in links.items() for w in pair]
        r = lab.ssh(host, shlex.join(["sh", "-c", _FIRST, "fc-first", "hide" if hide_others else "-", *words]))
        lines = r.stdout.split("\n")
        assert r.returncode == 0 and lines[0].startswith("/"), (r.stdout, r.stderr)
        self.dir, self.saved, self.hidden = lines[0], lines[1], [x for x in lines[2:] if x]

    def undo(self, first: str = "") -> None:
        back = (f"printf '%s\\n' {shlex.quote(self.saved)} > {RECORD}" if self.saved else f"rm -f {RECORD}")
        r = self.lab.ssh(self.host, first + "".join(f"umount {shlex.quote(f)}; " for f in self.hidden) +
                         f"umount {self.dir}; {back}; ! mountpoint -q {self.dir}")
        assert r.returncode == 0, (r.stdout, r.stderr)


def no_traceback(doc: dict) -> None:
    assert "Traceback" not in json.dumps(doc) and "NamedExpr" not in json.dumps(doc)


def test_a_36_python3_or_inventory_interpreter_gives_way_to_the_servers_own(server_lab, tmp_path):
    """Case 07 A-C on a host whose server runs from a 3.11 venv. B: python3 first on PATH is 3.6,
    no interpreter var: inspect is ok, the probes ran under the server's own interpreter (its
    /proc/PID/exe: what the facts probe records), the server's install is reported. A: the
    inventory names the 3.6 (platform-python): the same, and the inventory interpreter is listed as
    too old. C: `/usr/bin/env python3` is resolved on the host (to the 3.6 first on PATH) and
    passed over the same way, never refused as unsafe. (D, 3.13 first on PATH, ran before this
    issue too; the start under 3.13: tests/machine/test_interpreter_start.py.)"""
    pythons()
    first = FirstOnPath(server_lab, SERVER_HOST, {"python3": PY36, "platform-python": PY36})
    d = first.dir
    try:
        assert sh(server_lab, SERVER_HOST, "command -v python3; python3 -V").split() == [
            f"{d}/python3", "Python", "3.6.15"]  # the case is real: 3.6 is what the login finds first

        _, doc, hosts = server_lab.cli_json("inspect", SERVER_HOST, rc=0)  # B
        h = hosts[SERVER_HOST]
        no_traceback(doc)
        server = h["facts"]["servers"][0]
        inst = next(i for i in h["installs"] if i["id"] == server["install"])
        assert (inst["python"]["path"], inst["python"]["version"][:4]) == ("/opt/sglang/venv/bin/python", "3.11")
        assert inst["servers"] == [server["pid"]] and inst["sglang"]["version"] == "0.5.10"
        assert inst["allocator_call_sites"] and inst["scan"]["error"] is None
        exe, recorded = sh(server_lab, SERVER_HOST, f"readlink /proc/{server['pid']}/exe; cat {RECORD}").split()
        assert recorded == exe  # the server's own interpreter ran the probe (the facts probe records it)

        for value, named in ((f"{d}/platform-python", f"{d}/platform-python"),   # A
                             ("/usr/bin/env python3", f"{d}/python3")):          # C
            inv = inventory_with(server_lab, tmp_path, SERVER_HOST, ansible_python_interpreter=value)
            _, doc, hosts = server_lab.cli_json("inspect", SERVER_HOST, "-i", inv, rc=0)
            h = hosts[SERVER_HOST]
            no_traceback(doc)
            assert [i["id"] for i in h["installs"]] == [inst["id"]], value
            mine = next(c for c in h["facts"]["interpreter_discovery"]["considered"] if c["reason"] == "inventory")
            assert mine["python"] == named and "skipped" not in mine, (value, mine)
            assert mine["error"].strip().endswith(f"the probes need Python 3.8+; {named} is 3.6.15"), (value, mine)

    finally:
        first.undo()


def test_a_36_alone_fails_the_host_with_one_sentence(lab, tmp_path):
    """No server and no other Python 3.8+ (the host's python3.11 hidden by an empty non-executable
    file bound over it in that host's mount namespace): inspect fails the host, exit 2, with the
    one sentence naming the 3.6 and what to set; the same with `/usr/bin/env python3`."""
    pythons()
    first = FirstOnPath(lab, ALONE_HOST, {"python3": PY36}, hide_others=True)
    try:
        assert "/usr/bin/python3.11" in first.hidden, first.hidden
        # as the probe's start (sh) looks: dash's command -v finds only executables (bash's would say more)
        assert sh(lab, ALONE_HOST, "sh -c 'for n in python python3.11 python3; do command -v $n; done; true'").split() == [f"{first.dir}/python3"]
        inv = inventory_with(lab, tmp_path, ALONE_HOST, ansible_python_interpreter="/usr/bin/env python3")
        for args in ((), ("-i", inv)):
            _, doc, hosts = lab.cli_json("inspect", ALONE_HOST, *args, rc=2)
            assert (hosts[ALONE_HOST]["status"], hosts[ALONE_HOST]["error"]) == (
                "failed", SENTENCE.format(old=f"{first.dir}/python3 is 3.6.15")), args
    finally:
        first.undo()


# The stand-in container runtime CLI (a stand-in, named as one: the lab's containers here are not
# Podman's): `inspect ID` answers from $D/ID.json; `exec -i ID CMD...` never answers for an ID with
# $D/ID.hung, and otherwise runs CMD in the mount namespace of the pid in $D/ID.pid.
STANDIN_PODMAN = """#!/bin/sh
# fleetctl lab stand-in for podman: a runtime CLI whose exec hangs for one container
D=$(dirname "$0")/fc-podman
case $1 in
  inspect) exec cat "$D/$2.json";;
  exec) [ "$2" = -i ] || exit 125; id=$3; shift 3
        if [ -e "$D/$id.hung" ]; then exec sleep 86399; fi
        exec nsenter -t "$(cat "$D/$id.pid")" -m -- "$@";;
esac
echo "stand-in podman: $1 not supported" >&2; exit 125
"""
# $1 the stand-in's directory, $2 the fake checkout's directory, $3 the cgroup slice, then per
# container: name, container id, port, hung (1 or 0). Lays out the checkout and the stand-in, starts
# each container's server (a root process in a private mount namespace, in <slice>/libpod-<id>.scope)
# and prints "name pid" for each.
_CONTAINERS = r"""
bin=$1 top=$2 slice=$3; shift 3
mkdir -p "$top/sglang" "$bin/fc-podman" || exit 1
: > "$top/sglang/__init__.py"; echo '__version__ = "0.5.8"' > "$top/sglang/version.py"
echo 'import time; time.sleep(600)' > "$top/sglang/launch_server.py"
printf '%s' "$STANDIN" > "$bin/podman" && chmod 755 "$bin/podman" || exit 1
while [ $# -ge 4 ]; do
  name=$1 cid=$2 port=$3 hung=$4; shift 4
  cd "$top" && setsid unshare --mount --propagation private -- /usr/bin/python3 -m sglang.launch_server \
    --model-path m --port "$port" </dev/null >/dev/null 2>&1 &
  i=0; while ! pid=$(pgrep -f -n -- "--port $port\$"); do i=$((i + 1)); [ $i -lt 100 ] || exit 1; sleep 0.1; done
  mkdir -p "$slice/libpod-$cid.scope" && echo "$pid" > "$slice/libpod-$cid.scope/cgroup.procs" || exit 1
  printf '[{"Name": "%s", "ImageName": "localhost/fc-rt/%s:1", "Image": "%s", "State": {"Pid": %s}}]' \
    "$name" "$name" "$(echo "$cid" | rev)" "$pid" > "$bin/fc-podman/$cid.json"
  echo "$pid" > "$bin/fc-podman/$cid.pid"; [ "$hung" = 1 ] && : > "$bin/fc-podman/$cid.hung"
  echo "$name $pid"
done
"""


@pytest.fixture
def runtime(lab):
    """On RUNTIME_HOST: STANDIN_PODMAN as `podman` first on PATH (root's, on a root tmpfs:
    FirstOnPath), and two "containers" (hung, answering), each a root server process of a fake
    SGLang 0.5.8 checkout (in its working directory) in its own private mount namespace, moved
    into a root-owned libpod-<id>.scope cgroup. Yields {name: (container id, host pid)} and the
    checkout's directory; all of it removed after."""
    top = f"/tmp/fc-rt-{secrets.token_hex(4)}"
    slice_ = f"/sys/fs/cgroup/unified/fc-rt-{secrets.token_hex(4)}.slice"
    first = FirstOnPath(lab, RUNTIME_HOST, {})
    cids = {"fc-hung": secrets.token_hex(32), "fc-answers": secrets.token_hex(32)}
    args = [first.dir, top, slice_, "fc-hung", cids["fc-hung"], "39201", "1", "fc-answers", cids["fc-answers"], "39202", "0"]
    made = {}
    try:
        r = lab.ssh(RUNTIME_HOST, f"STANDIN={shlex.quote(STANDIN_PODMAN)} " + shlex.join(["sh", "-c", _CONTAINERS, "fc", *args]))
        for line in r.stdout.splitlines():
            name, pid = line.split()
            made[name] = (cids[name], int(pid))
        assert r.returncode == 0 and len(made) == 2, (r.stdout, r.stderr)
        yield made, top
    finally:
        first.undo("".join(f"kill -9 {pid}; " for _, pid in made.values()) + "sleep 0.3; " +
                   "".join(f"rmdir {slice_}/libpod-{cid}.scope; " for cid in cids.values()) +
                   f"rmdir {slice_}; rm -rf {top}; ")


def test_a_hung_runtime_exec_costs_only_its_own_install(lab, runtime):
    """inspect within 20 s: the host's facts probe, then each container on its own share of the
    time left (an equal share each, one kept for the host). The hung container's exec is killed at
    its share: it is not_inspected with "podman exec hung: no answer in N s" (N its share), the
    host's own install and the answering container's checkout are reported, exit 0, and no
    hung exec is left on the host."""
    made, top = runtime
    t0 = time.monotonic()
    _, doc, hosts = lab.cli_json("inspect", RUNTIME_HOST, "--timeout", "20", rc=0)
    took = time.monotonic() - t0
    h = hosts[RUNTIME_HOST]
    assert h["status"] == "ok", h["error"]
    entries = {c["root"]["name"]: c for c in h["facts"]["containers"]}
    assert [c["root"]["container_id"] for c in h["facts"]["containers"]] == [made["fc-hung"][0], made["fc-answers"][0]]
    assert all(c["kind"] == "container" and c["entered_with"] == "podman" for c in entries.values()), entries

    hung = entries["fc-hung"]["error"]
    m = re.fullmatch(r"entering podman:fc-hung: with podman: podman exec hung: no answer in (\d+) s", hung or "")
    assert m, hung
    assert 3 <= int(m.group(1)) <= 7, hung  # its share: a third of the 20 s less the facts probe's time
    unseen = [u for u in h.get("not_inspected", []) if (u.get("root") or {}).get("container_id") == made["fc-hung"][0]]
    assert len(unseen) == 1 and unseen[0]["status"] == "not_inspected", h.get("not_inspected")
    assert f"podman exec hung: no answer in {m.group(1)} s" in unseen[0]["reason"]

    ids = [i["id"] for i in h["installs"]]
    assert any(i.startswith("host:/opt/sglang/venv/") for i in ids), ids  # the host's own
    answers = next(i for i in h["installs"] if i["id"] == f"podman:fc-answers:{top}/sglang")
    assert (answers["sglang"]["version"], answers["sglang"]["install"]) == ("0.5.8", "checkout")
    assert answers["servers"] == [made["fc-answers"][1]] and entries["fc-answers"]["error"] is None
    assert not any(i.startswith("podman:fc-hung:") for i in ids)
    assert took < 20
    assert lab.ssh(RUNTIME_HOST, "pgrep -f 'sleep 86399'").returncode == 1  # the remote deadline killed it
