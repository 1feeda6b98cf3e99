"""`fleetctl inspect --allocator-replay` through real sshd on the lab's four releases (the `lab`
fixture): each host's own allocator classes, loaded from the release's own files with triton and
the other sglang modules stubbed, replayed on the host's CPU with the host's torch (the lab venvs
include the lab Python's site-packages, torch 2.13.0 CPU, as the kernel deploy tests' builds use
it), need_sort False then True. The traces are small (their parameters are flags): one start of
torch per install and run, three runs in all.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

# a pool with room for everything the trace runs at once (no retraction), and one far too small
HEADROOM = ["--pool", "32768", "--concurrency", "16", "--input", "64:1024", "--output", "16:512", "--requests", "160",
            "--seed", "7"]
PRESSURE = ["--pool", "4096", "--concurrency", "32", "--input", "64:1024", "--output", "16:512", "--requests", "120",
            "--seed", "7"]
WITH_SORT = ["0.5.2", "0.5.10", "0.5.23"]
# where each release keeps the classes (read from the wheels: allocator.py from 0.5.2, a package in 0.5.23)
FILES = {"0.4.6.post5": ("sglang/srt/mem_cache/memory_pool.py", "sglang/srt/mem_cache/paged_allocator.py"),
         "0.5.2": ("sglang/srt/mem_cache/allocator.py",) * 2, "0.5.10": ("sglang/srt/mem_cache/allocator.py",) * 2,
         "0.5.23": ("sglang/srt/mem_cache/allocator/token.py", "sglang/srt/mem_cache/allocator/paged.py")}
# the fields the issue names for each run
FIELDS = {"need_sort", "runs_per_alloc_mean", "runs_per_alloc_p99", "contiguous_share", "sorts", "sort_s"}
DOCTORED = "/tmp/fleetctl-doctored-venv"


def by_release(hosts: dict) -> dict[str, tuple[str, dict]]:
    """{sglang version: (host, its one install)} of a --json inspect document's hosts."""
    out = {}
    for name, h in hosts.items():
        assert h["status"] == "ok", (name, h["error"])
        (inst,) = h["installs"]
        out[inst["sglang"]["version"]] = (name, inst)
    return out


def pairs(inst: dict) -> dict[str, tuple[dict, dict]]:
    """{kind: (the need_sort=False run, the need_sort=True run)} of an install's allocator_replay."""
    runs = inst["allocator_replay"]
    return {k: tuple(next(r for r in runs if r["kind"] == k and r["need_sort"] is ns) for ns in (False, True))
            for k in ("token", "paged")}


@pytest.fixture(scope="module")
def headroom(lab):
    _, _, hosts = lab.cli_json("inspect", "all", "--allocator-replay", *HEADROOM, rc=0)
    return by_release(hosts)


def test_with_headroom_need_sort_gives_fewer_runs_and_the_old_release_has_none(headroom):
    assert sorted(headroom) == sorted(WITH_SORT + ["0.4.6.post5"])
    for version in WITH_SORT:
        _, inst = headroom[version]
        info = inst["allocator_replay_info"]
        assert info["status"] == "replayed" and info["reason"] is None, (version, info)
        assert info["trace"] == {"pool": 32768, "pool_source": "--pool", "concurrency": 16, "input": [64, 1024],
                                 "output": [16, 512], "aborts": 0.1, "seed": 7, "requests": 160, "page_size": 16}
        assert info["torch"].startswith("2.13.0"), info
        assert [(c["kind"], c["class"], c["file"], c["need_sort"]) for c in info["classes"]] == [
            ("token", "TokenToKVPoolAllocator", FILES[version][0], True),
            ("paged", "PagedTokenToKVPoolAllocator", FILES[version][1], True)]
        # 0.5.2 and 0.5.10 import triton for their kernels; 0.5.23's paged.py imports them from sglang.kernels
        assert ("sglang.kernels.ops.memory.allocator" if version == "0.5.23" else "triton") in info["stubbed"], info
        assert all(m.split(".")[0] in ("sglang", "triton") for m in info["stubbed"]), info["stubbed"]
        assert len(inst["allocator_replay"]) == 4
        for kind, (off, on) in pairs(inst).items():
            assert FIELDS <= set(off) and FIELDS <= set(on)
            # the whole trace admitted once each: nothing retracted with headroom
            assert off["prefills"] == on["prefills"] == 160 and off["retractions"] == on["retractions"] == 0
            assert off["sorts"] == 0 and off["sort_s"] == 0
            assert 0 < on["sorts"] < on["prefills"] / 2 and on["sort_s"] > 0, (version, kind, on)
            # the point: sorting the free list leaves prefill allocations in fewer contiguous runs
            assert on["runs_per_alloc_mean"] < 0.8 * off["runs_per_alloc_mean"], (version, kind, off, on)
            assert on["runs_per_alloc_p99"] <= off["runs_per_alloc_p99"], (version, kind, off, on)
    _, old = headroom["0.4.6.post5"]
    info = old["allocator_replay_info"]
    assert info["status"] == "no_need_sort" and old["allocator_replay"] == []
    assert info["reason"].startswith("no need_sort: TokenToKVPoolAllocator (sglang/srt/mem_cache/memory_pool.py:169) "
                                     "takes no need_sort"), info
    assert [(c["file"], c["need_sort"]) for c in info["classes"]] == [(FILES["0.4.6.post5"][0], False),
                                                                      (FILES["0.4.6.post5"][1], False)]


def test_under_pressure_need_sort_sorts_on_most_admissions(lab, headroom):
    pattern = ":".join(headroom[v][0] for v in WITH_SORT)
    _, _, hosts = lab.cli_json("inspect", pattern, "--allocator-replay", *PRESSURE, rc=0)
    pressed = by_release(hosts)
    assert sorted(pressed) == sorted(WITH_SORT)
    for version, (_, inst) in pressed.items():
        assert inst["allocator_replay_info"]["status"] == "replayed", inst["allocator_replay_info"]
        for kind, (off, on) in pairs(inst).items():
            assert off["retractions"] > 0 and off["prefills"] > 120, (version, kind, off)  # re-admissions
            assert on["sorts"] >= 0.8 * on["prefills"], (version, kind, on)


def test_a_file_that_imports_more_is_reported_and_the_replay_is_deterministic(lab, headroom, tmp_path):
    """A copy of the 0.5.2 venv whose allocator.py imports a module nobody installed, named by the
    inventory as the host's interpreter (so a second install): its replay says which file and line
    need what, the host stays ok, and the real install's replay, in the human report, shows the
    same figures as the first run with the same seed."""
    host, inst = headroom["0.5.2"]
    site = inst["sglang"]["location"]
    doctored = f"{DOCTORED}{site[len('/opt/sglang/venv'):]}/sglang/srt/mem_cache/allocator.py"
    r = lab.ssh(host, f"cp -a /opt/sglang/venv {DOCTORED} && sed -i 's/^import torch$/import torch\\n"
                      f"import fleetctl_doctored_dependency/' {doctored} && grep -n '^import fleetctl_doctored' {doctored}")
    try:
        assert r.returncode == 0, r.stderr
        line = int(r.stdout.split(":")[0])
        doc = yaml.safe_load(lab.inventory.read_text())
        entry = doc["all"]["children"]["lab"]["hosts"][host]
        inv = tmp_path / "hosts.yaml"
        inv.write_text(yaml.safe_dump({"all": {"hosts": {host: {**entry,
                                                               "ansible_python_interpreter": f"{DOCTORED}/bin/python"}}}}))
        shown = lab.cli("inspect", host, "-i", str(inv), "--allocator-replay", *HEADROOM, env={"COLUMNS": "2000"})
    finally:
        lab.ssh(host, f"rm -rf {DOCTORED}")
    assert shown.returncode == 0, shown.stdout[-3000:] + shown.stderr[-2000:]
    out = shown.stdout
    assert (f"not replayed: sglang/srt/mem_cache/allocator.py line {line} needs more than the replay gives it: "
            "ModuleNotFoundError: No module named 'fleetctl_doctored_dependency' (neither installed nor stubbed") in out, out
    (off, on), (poff, pon) = pairs(inst)["token"], pairs(inst)["paged"]
    share = lambda r: f"{r['contiguous_share']:.0%}"  # noqa: E731
    expected = (rf"defrag-tier0 here \(with headroom\): token {off['runs_per_alloc_mean']:.1f} -> "
                rf"{on['runs_per_alloc_mean']:.1f} runs per prefill \([\d.]+x fewer; contiguous {share(off)} -> "
                rf"{share(on)}; {on['sorts']} sorts in 160 prefills, [\d.]+ ms max\); paged/16 "
                rf"{poff['runs_per_alloc_mean']:.1f} -> {pon['runs_per_alloc_mean']:.1f} runs per prefill .*"
                rf"{pon['sorts']} sorts in 160 prefills, [\d.]+ ms max\) \[pool 32768 \(--pool\), 16 concurrent, "
                rf"160 requests, seed 7\]")
    assert re.search(expected, out), out
    assert len(re.findall(r"^.*(defrag-tier0 here|not replayed: ).*$", out, re.M)) == 2, out


def test_with_a_server_and_no_pool_the_replay_is_sized_from_its_server_info(server_lab):
    """No --pool: the pool is the max_total_num_tokens the install's server states in /server_info,
    asked through the target rule; the figure is held against the stand-in's answer read on the
    host apart (a stand-in that states none leaves the default pool, saying why)."""
    _, _, hosts = server_lab.cli_json("inspect", "sglang_0_5_2", "--allocator-replay", "--requests", "40",
                                      "--input", "64:256", "--output", "16:128", rc=0)
    ((name, host),) = hosts.items()
    (server,) = host["facts"]["servers"]
    (inst,) = host["installs"]
    info = inst["allocator_replay_info"]
    assert info["status"] == "replayed", info
    r = server_lab.ssh(name, "python3 -c 'import json, urllib.request; print(json.dumps(json.load(urllib.request.urlopen("
                             "\"http://127.0.0.1:30000/server_info\")).get(\"max_total_num_tokens\")))'")
    assert r.returncode == 0, r.stderr
    stated = json.loads(r.stdout)
    label = f"server pid {server['pid']} at 127.0.0.1:30000"
    if stated is None:
        assert (info["trace"]["pool"], info["trace"]["pool_source"]) == (
            65536, f"default; {label}: /server_info states no max_total_num_tokens (a stand-in)"), info["trace"]
    else:
        assert (info["trace"]["pool"], info["trace"]["pool_source"]) == (
            stated, f"max_total_num_tokens of {label}"), info["trace"]
    assert {r["kind"] for r in inst["allocator_replay"]} == {"token", "paged"}
