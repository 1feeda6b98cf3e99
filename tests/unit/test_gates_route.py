"""The route gate's control side (engine/gates/route.py): its checks over recorded and hand-built
route check answers (probes/traffic/routecheck.py shapes), the build the evidence must show (the
one just activated, of the package deployed), the baseline that refuses a host, where the
playbook and deploy ask for it, and its place in the change engine (baseline before the write,
the gate after the smoke gate passed, its failure a rollback)."""

from __future__ import annotations

import copy
import json
import textwrap
import time
from pathlib import Path

import pytest

from fleetctl import inventory
from fleetctl.engine import changes
from fleetctl.engine.changes import Change, ChangeOptions, execute
from fleetctl.engine.context import HostContext, HostResult
from fleetctl.engine.gates import GateResult
from fleetctl.engine.gates import route as routegate
from fleetctl.engine.gates import smoke as smokegate
from fleetctl.engine.gates.route import RouteGate, RouteOptions, compare_route, expected_ranks, route_problems
from fleetctl.engine.gates.smoke import SmokeGate
from fleetctl.errors import HostFailed
from fleetctl.probes.traffic import routecheck
from fleetctl.vocab import GateStatus, HostStatus

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "route"
N = 6
KEY = "1a2b3c4d5e6f" + "0" * 52  # the build key just activated
GATE = RouteGate("verify_attention", KEY)
BUILD = GATE.build  # what the hook names as its "build": PUBLIC/verify_attention/KEY


def prompt(name, ids=None, lps=None, gaps=None, verify=3, tokens=None, chars=100, error=None):
    """One prompt's answer as route_server gives it: ids, logprobs, top-2 (gap: top-1 - top-2)."""
    ids = list(ids if ids is not None else [10 + i for i in range(N)])
    lps = list(lps if lps is not None else [-0.1] * len(ids))
    gaps = list(gaps if gaps is not None else [1.0] * len(ids))
    return {"name": name, "chars": chars, "tries": 1, "output_ids": ids, "prompt_tokens": tokens or 20,
            "completion_tokens": len(ids), "spec_verify_ct": verify, "logprobs": lps,
            "top2": [[[lp, t], [None if lp is None else lp - g, t + 1]] for lp, t, g in zip(lps, ids, gaps)],
            "error": error}


def rec(pid, eager=0, captured=(), start=1000, fallbacks=None, build=BUILD):
    return {"pid": pid, "uid": 0, "start_time": start, "build": build, "module": f"{build}/build/m.so",
            "captured": list(captured), "captured_total": len(captured), "eager_routed": eager,
            "fallbacks": fallbacks or {}, "written": 1.0, "trigger": "eager"}


def entry(pid, state="fresh", **kw):
    return {"pid": pid, "uid": 0, "start_time": 1000, "state": state, "why": None if state == "fresh" else "why",
            "record": rec(pid, **kw) if state in ("fresh", "stale") else None}


def server(prompts=None, before=None, after=None, info=(), ok=True, error=None, port=30000):
    info = None if info is None else dict({"tp_size": 1, "pp_size": 1, "dp_size": 1, "enable_dp_attention": False, "nnodes": 1,
                 "context_length": 8192, "speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4},
                **dict(info))
    ps = prompts if prompts is not None else [prompt("fox"), prompt("count"), prompt("code"),
                                              prompt("long", tokens=4160, chars=4160)]
    return {"host": "127.0.0.1", "port": port, "pid": 7, "node_rank": 0, "ok": ok, "error": error,
            "health_wait_s": 0.0, "server_info": info, "prompts": ps,
            "evidence": {"before": before if before is not None else [entry(7, eager=0)],
                         "after": after if after is not None else [entry(7, eager=8)]}}


def answer(*servers, refused=()):
    return {"servers": list(servers), "refused": list(refused), "evidence_dir": "/var/lib/fleetctl-kernels/route-evidence"}


BASE = answer(server(before=[entry(7, state="missing")], after=[entry(7, state="missing")]))


def verdict(after, base=BASE, build=BUILD, **opts) -> tuple[dict, GateResult]:
    r = compare_route(base, after, RouteOptions(**opts), build=build)
    return {c.name: c for c in r.checks}, r


def with_prompt(i, **kw):
    ps = [prompt("fox"), prompt("count"), prompt("code"), prompt("long", tokens=4160, chars=4160)]
    ps[i] = prompt(ps[i]["name"], **dict({"tokens": ps[i]["prompt_tokens"], "chars": ps[i]["chars"]}, **kw))
    return ps


def test_identical_and_routed_passes_every_check():
    c, r = verdict(answer(server()))
    assert r.passed and list(c) == list(routegate.CHECKS)
    assert all(x.passed for x in c.values())
    assert "1 of 1 expected ranks" in c["ranks"].detail and "eager_routed 0 -> 8" in c["ranks"].detail
    assert "4 prompts identical" in c["tokens"].detail and "4160 prompt tokens" in c["long prompt"].detail
    assert "2.000 vs baseline 2.000" in c["accept length"].detail


def test_a_token_that_differs_where_the_baseline_was_sure_fails_however_close_the_ids():
    ids = [10 + i for i in range(N)]
    ids[3] = 14  # the baseline's 13 + 1: a numeric closeness must not matter
    c, r = verdict(answer(server(prompts=with_prompt(1, ids=ids))))
    assert r.failed and not c["tokens"].passed
    assert "count: output_ids differ at position 3: baseline token 13 vs after 14" in c["tokens"].detail
    assert "1.0000 apart" in c["tokens"].detail and "differ" in r.message
    assert c["logprobs"].passed  # up to the divergence they agree


def test_a_near_tie_is_reported_not_failed_and_later_positions_are_not_compared():
    ids = [10, 11, 99, 98, 97, 96]  # diverges at 2 and follows another path after it
    lps = [-0.1, -0.1, -0.1, -3.0, -3.0, -3.0]
    base = answer(server(prompts=with_prompt(0, gaps=[1.0, 1.0, 0.015, 1.0, 1.0, 1.0])))
    c, r = verdict(answer(server(prompts=with_prompt(0, ids=ids, lps=lps))), base)
    assert r.passed, r.message
    assert c["tokens"].passed and "near tie at position 2" in c["tokens"].detail
    assert c["logprobs"].passed and "20 output logprobs" in c["logprobs"].detail  # 2 before the tie + 3 x 6
    # the same divergence where the baseline's top two were 0.5 apart is a failure
    base = answer(server(prompts=with_prompt(0, gaps=[1.0, 1.0, 0.5, 1.0, 1.0, 1.0])))
    c, r = verdict(answer(server(prompts=with_prompt(0, ids=ids, lps=lps))), base)
    assert r.failed and "output_ids differ at position 2" in c["tokens"].detail
    # the tie limit is inclusive; the after side's own top two do not matter
    base = answer(server(prompts=with_prompt(0, gaps=[1.0, 1.0, 0.02, 1.0, 1.0, 1.0])))
    assert verdict(answer(server(prompts=with_prompt(0, ids=ids, lps=lps, gaps=[0.5] * N))), base)[1].passed
    # a baseline without top-2 logprobs there is no near tie
    b = copy.deepcopy(base)
    b["servers"][0]["prompts"][0]["top2"][2] = []
    assert verdict(answer(server(prompts=with_prompt(0, ids=ids, lps=lps))), b)[1].failed


def test_a_shorter_answer_diverges_where_it_ends():
    c, r = verdict(answer(server(prompts=with_prompt(2, ids=[10, 11, 12]))))
    assert r.failed and "position 3: baseline token 13 vs after end" in c["tokens"].detail


def test_logprobs_within_the_tolerance_up_to_the_divergence():
    c, r = verdict(answer(server(prompts=with_prompt(0, lps=[-0.1, -0.119, -0.1, -0.1, -0.1, -0.1]))))
    assert r.passed and "largest |diff| 0.0190 at fox position 1" in c["logprobs"].detail
    # float noise (shown as 0.0000) has no place worth naming: it moves from run to run
    c, r = verdict(answer(server(prompts=with_prompt(0, lps=[-0.1, -0.1, -0.1000004, -0.1, -0.1, -0.1]))))
    assert r.passed and c["logprobs"].detail.endswith("(largest |diff| 0.0000)"), c["logprobs"].detail
    c, r = verdict(answer(server(prompts=with_prompt(0, lps=[-0.1, -0.1, -0.1, -0.1, -0.131, -0.1]))))
    assert r.failed and "fox position 4: -0.1310 vs baseline -0.1000" in c["logprobs"].detail
    c, r = verdict(answer(server(prompts=with_prompt(0, lps=[-0.1, None, -0.1, -0.1, -0.1, -0.1]))))
    assert r.failed and "no logprob (after)" in c["logprobs"].detail
    assert verdict(answer(server(prompts=with_prompt(0, lps=[-0.1, -0.125] + [-0.1] * 4))), logprob_tolerance=0.03)[1].passed


def test_each_limit_is_inclusive_and_the_next_step_past_it_fails():
    """The near tie, logprob, long-prompt and accept-length limits at their defaults: exactly the
    limit (as floats compute it) passes, the next step past it fails, both ways."""
    ids = [10, 11, 99, 98, 97, 96]
    tie = [1.0, 1.0, 0.03, 1.0, 1.0, 1.0]  # 0.03 apart: past the 0.02 near tie
    c, r = verdict(answer(server(prompts=with_prompt(0, ids=ids))), answer(server(prompts=with_prompt(0, gaps=tie))))
    assert r.failed and "output_ids differ at position 2" in c["tokens"].detail
    # |diff| 0.020000000000000004 as floats compute -0.08 - -0.1: the tolerance, inclusive
    assert verdict(answer(server(prompts=with_prompt(0, lps=[-0.1, -0.08] + [-0.1] * 4))))[1].passed
    c, r = verdict(answer(server(prompts=with_prompt(0, lps=[-0.1, -0.0799] + [-0.1] * 4))))
    assert r.failed and "fox position 1" in c["logprobs"].detail
    assert verdict(answer(server(prompts=with_prompt(3, tokens=4096))))[1].passed
    c, r = verdict(answer(server(prompts=with_prompt(3, tokens=4095))))
    assert r.failed and c["long prompt"].detail == "4095 prompt tokens, fewer than 4096"
    # an accept length that rises past 5% fails as a drop does (24 / 11 = 2.18 against 2.0)
    base = answer(server(prompts=[prompt("fox"), prompt("count"), prompt("code"), prompt("long", tokens=4160, chars=4160)]))
    c, r = verdict(answer(server(prompts=[prompt("fox"), prompt("count"), prompt("code"),
                                          prompt("long", tokens=4160, chars=4160, verify=2)])), base)
    assert r.failed and "2.182 vs baseline 2.000" in c["accept length"].detail and "over 5%" in c["accept length"].detail


def test_a_rank_that_never_routes_fails_naming_its_pid_and_its_fallbacks():
    after = answer(server(before=[entry(7, eager=5)], after=[entry(7, eager=5, fallbacks={"shape not enabled": 40})]))
    c, r = verdict(after)
    assert r.failed and not c["ranks"].passed
    assert "0 of 1 expected ranks" in c["ranks"].detail
    assert "pid 7 did not route during the check" in c["ranks"].detail and "'shape not enabled' x40" in c["ranks"].detail


def test_a_stale_or_missing_or_refused_record_counts_for_nothing():
    for e in (entry(7, state="stale", eager=50), entry(7, state="missing"), entry(7, state="refused"),
              entry(7, state="gone")):
        c, r = verdict(answer(server(before=[], after=[e])))
        assert r.failed and f"pid 7 {e['state']}" in c["ranks"].detail, e
    # a record of an earlier process with this pid before the prompts is no starting count: it routed now
    before = entry(7, eager=100, start=999)
    assert verdict(answer(server(before=[before], after=[entry(7, eager=3)])))[1].passed


def test_a_capture_of_the_servers_draft_width_counts_as_routed():
    cap = [{"batch": 1, "draft_tokens": 4, "head_dim": 64, "group": 2, "dtype": "bfloat16"}]
    c, r = verdict(answer(server(before=[entry(7, captured=cap)], after=[entry(7, captured=cap)])))
    assert r.passed and "captured batch 1 for draft width 4" in c["ranks"].detail
    other = [dict(cap[0], draft_tokens=3)]
    assert verdict(answer(server(before=[], after=[entry(7, captured=other)])))[1].failed
    zero = [dict(cap[0], batch=0)]
    assert verdict(answer(server(before=[], after=[entry(7, captured=zero)])))[1].failed


def test_evidence_of_another_kernel_package_or_another_build_fails_the_ranks():
    """The gate is given the package and build key just activated: a rank whose evidence names
    another package's build (a second kernel package deployed on a host the verify_attention hook
    routes) or another build of the same package (the one active before) counts for nothing,
    however much it routed."""
    routed_va = answer(server(after=[entry(7, eager=8)]))  # the hook routed verify_attention's KEY
    assert verdict(routed_va)[1].passed
    other_pkg = RouteGate("paged_attention", "9f" * 32)
    c, r = verdict(routed_va, build=other_pkg.build)
    assert r.failed and not c["ranks"].passed and "0 of 1 expected ranks" in c["ranks"].detail
    assert (f"pid 7 serves build {BUILD}, not /var/lib/fleetctl-kernels/paged_attention/{'9f' * 32} "
            "(eager_routed 0 -> 8)") in c["ranks"].detail
    assert all(x.passed for n, x in c.items() if n != "ranks")  # the tokens are the same: only the build tells
    previous = RouteGate("verify_attention", "0" * 64)
    c, r = verdict(routed_va, build=previous.build)
    assert r.failed and f"pid 7 serves build {BUILD}, not {previous.build}" in c["ranks"].detail
    # two ranks, one of them still on the previous build (a process the restart did not replace)
    mixed = answer(server(info={"tp_size": 2}, before=[entry(7), entry(8)],
                          after=[entry(7, eager=4), entry(8, eager=4, build=previous.build)]))
    c, r = verdict(mixed)
    assert r.failed and "1 of 2 expected ranks" in c["ranks"].detail and f"pid 8 serves build {previous.build}" in \
        c["ranks"].detail
    # a rank that did not route and names another build says why it counts for nothing, with its fallbacks
    idle = answer(server(after=[entry(7, eager=0, build=previous.build, fallbacks={"shape not enabled": 3})]))
    assert "(fallbacks 'shape not enabled' x3)" in verdict(idle)[0]["ranks"].detail
    # no build active when the change was planned: nothing it routes can be checked
    c, r = verdict(routed_va, build=RouteGate("verify_attention", None).build)
    assert r.failed and "no build of the routed kernel was active" in c["ranks"].detail


def test_expected_ranks_follow_the_parallel_layout():
    assert expected_ranks({"tp_size": 2, "pp_size": 1, "dp_size": 2, "enable_dp_attention": False, "nnodes": 1}) == 4
    assert expected_ranks({"tp_size": 2, "pp_size": 1, "dp_size": 2, "enable_dp_attention": True, "nnodes": 1}) == 2
    assert expected_ranks({"tp_size": 4, "pp_size": 2, "dp_size": 1, "enable_dp_attention": False, "nnodes": 2}) == 4
    assert expected_ranks({"tp_size": 3, "nnodes": 2}) is None and expected_ranks({}) == 1
    two = [entry(7, eager=4), entry(8, eager=0)]
    c, r = verdict(answer(server(info={"tp_size": 2}, before=[entry(7), entry(8)], after=two)))
    assert r.failed and "1 of 2 expected ranks" in c["ranks"].detail and "pid 8 did not route" in c["ranks"].detail
    c, r = verdict(answer(server(info={"tp_size": 2}, before=[entry(7), entry(8)],
                                 after=[entry(7, eager=4), entry(8, eager=4)])))
    assert r.passed and "tp 2 x pp 1 x dp 1 / nnodes 1" in c["ranks"].detail


def test_the_long_prompt_must_run_and_reach_its_tokens():
    c, r = verdict(answer(server(prompts=with_prompt(3, tokens=4000))))
    assert r.failed and c["long prompt"].detail == "4000 prompt tokens, fewer than 4096"
    ps = with_prompt(3)
    ps[3]["error"] = "the server's context_length 2048 cannot hold a 4096-token prompt and 24 new tokens: not sent"
    c, r = verdict(answer(server(prompts=ps)))
    assert r.failed and "context_length 2048" in c["long prompt"].detail
    c, r = verdict(answer(server(prompts=with_prompt(3)[:3])))
    assert not c["long prompt"].passed and "long: no answer after the change" in c["tokens"].detail


def test_the_accept_length_within_five_percent_of_the_baselines():
    def verify(v):
        return [prompt("fox", verify=v), prompt("count", verify=v), prompt("code", verify=v),
                prompt("long", tokens=4160, chars=4160, verify=v)]
    base = answer(server(prompts=verify(3)))  # 24 tokens / 12 steps = 2.0
    c, r = verdict(answer(server(prompts=verify(3))), base)
    assert r.passed
    c, r = verdict(answer(server(prompts=[*verify(3)[:3], prompt("long", tokens=4160, chars=4160, verify=4)])), base)
    assert r.failed and "1.846 vs baseline 2.000" in c["accept length"].detail  # 24 / 13: 7.7% off
    c, r = verdict(answer(server(prompts=[*verify(3)[:3], prompt("long", tokens=4160, chars=4160, verify=4)])), base,
                   accept_tolerance=0.08)
    assert r.passed
    c, r = verdict(answer(server(prompts=verify(0))), base)
    assert r.failed and "reported no spec_verify_ct" in c["accept length"].detail


def test_a_server_that_does_not_speculate_says_so_and_fails_on_its_ranks():
    plain = {"speculative_algorithm": None, "speculative_num_draft_tokens": None}
    def ps():
        return [prompt(n, verify=0, tokens=4160 if n == "long" else None, chars=4160 if n == "long" else 100)
                for n in ("fox", "count", "code", "long")]
    base = answer(server(info=plain, prompts=ps(), before=[entry(7, state="missing")], after=[entry(7, state="missing")]))
    c, r = verdict(answer(server(info=plain, prompts=ps(), before=[entry(7, state="missing")],
                                 after=[entry(7, state="missing")])), base)
    assert c["accept length"].passed and "the baseline does not speculate" in c["accept length"].detail
    assert r.failed and not c["ranks"].passed and "nothing verifies" in c["ranks"].detail


def test_a_missing_or_failed_side_is_one_check():
    c, r = verdict(answer())
    assert r.failed and list(c) == ["server"] and "missing after the change" in c["server"].detail
    c, r = verdict(answer(server(ok=False, error="fox: /generate answered HTTP 500", info=None)))
    assert r.failed and "route run" in c and "HTTP 500" in c["route run"].detail
    skipped = compare_route(answer(), answer(), build=BUILD)
    assert (skipped.status, skipped.reason) == (GateStatus.SKIPPED, "no server")


def test_a_failing_baseline_is_named_and_refuses_the_host():
    assert route_problems(BASE) == []
    bad = answer(server(ok=False, error="health deadline exceeded after 60 s: last answer HTTP 503 (still starting)"))
    assert route_problems(bad) == ["route 127.0.0.1:30000: health deadline exceeded after 60 s: last answer HTTP 503 "
                                   "(still starting)"]
    short = answer(server(prompts=with_prompt(3, tokens=100)))
    assert route_problems(short) == ["route 127.0.0.1:30000: the long prompt did not make 4096 tokens"]
    assert route_problems(answer(refused=[{"pid": 3, "host": "0.0.0.0", "port": 1, "reason": "r"}])) == [
        "no server to route-check (nothing sent): pid 3 (claims 0.0.0.0:1): r"]


def test_recorded_probe_answers_pass_and_a_broken_kernels_fail():
    """Answers recorded from the route check probe (main) against test_routecheck.Fake, a speculating
    SGLang-shaped server whose hook evidence grows per request, and one whose tokens shift from
    position 5 (tests/golden/route; ports set to 30000), their hook evidence naming build k of
    package x."""
    base = json.loads((GOLDEN / "baseline.json").read_text())
    routed = json.loads((GOLDEN / "routed.json").read_text())
    broken = json.loads((GOLDEN / "broken.json").read_text())
    assert route_problems(base) == []
    c, r = verdict(routed, base, build=RouteGate("x", "k").build)
    assert r.passed, r.message
    assert verdict(routed, base, build=RouteGate("x", "k2").build)[1].failed  # another build than the one recorded
    c, r = verdict(broken, base, build=RouteGate("x", "k").build)
    assert r.failed and not c["tokens"].passed and "differ" in c["tokens"].detail


# ---- where it is asked for, and its place in the change engine --------------------------------

def test_the_playbook_step_and_the_shipped_playbook(tmp_path):
    from fleetctl.engine.playbooks.model import VALIDATE_STEPS, load_playbook
    from fleetctl.errors import ParseError

    assert "route" in VALIDATE_STEPS
    pb = load_playbook(ROOT / "playbooks" / "route-verify-attention.yaml")
    assert [v.step for v in pb.validate] == ["compile", "reinspect", "smoke", "route"]
    (tmp_path / "v.j2").write_text("True\n")
    (tmp_path / "c.j2").write_text("# fleetctl t:\n")
    body = textwrap.dedent("""\
        name: t
        tasks:
          - name: edit
            edit_expressions: {findings: x, when: "true", value: v.j2, comment: c.j2, marker: "fleetctl t:"}
        validate:
        """)
    for steps, said in (("  - route\n", "put a smoke step before it"),
                        ("  - smoke\n  - route\n  - route\n", "a second route step"),
                        ("  - smoke\n  - route: {profile: x}\n", "unknown key 'profile'")):
        (tmp_path / "pb.yaml").write_text(body + steps)
        with pytest.raises(ParseError, match=said):
            load_playbook(tmp_path / "pb.yaml")
    (tmp_path / "pb.yaml").write_text(body + "  - smoke\n  - route: {when: \"fleetctl_route | default(true)\"}\n")
    assert load_playbook(tmp_path / "pb.yaml").validate[1].step == "route"


class Probe:
    """The host side of the change engine, as data: each change probe action recorded, the smoke
    decode and gate passing, the route check answering `answers` in turn."""

    def __init__(self, monkeypatch, answers, smoke_ok=True):
        self.actions, self.answers, self.routes = [], list(answers), 0

        def change_probe(ctx, action, state_dir, python=None, **params):
            self.actions.append(action)
            return {"ok": True}

        def run_route(ctx, targets, facts, opts, health_timeout, reserve=0.0):
            self.routes += 1
            return self.answers.pop(0)

        smoke_res = {"servers": [{"host": "127.0.0.1", "port": 30000, "ok": True}], "refused": [], "offline": None}
        monkeypatch.setattr(changes, "change_probe", change_probe)
        monkeypatch.setattr(smokegate, "smoke", lambda *a, **k: smoke_res)
        monkeypatch.setattr(changes, "smoke", lambda *a, **k: smoke_res)  # the health check after a rollback
        monkeypatch.setattr(smokegate, "smoke_problems", lambda res: [])
        monkeypatch.setattr(changes, "run_handlers", lambda ctx, hs: [{"name": h["name"], "exit_code": 0} for h in hs])
        monkeypatch.setattr(smokegate, "gate", lambda *a: GateResult(GateStatus.PASSED if smoke_ok else GateStatus.FAILED,
                                                                    message="" if smoke_ok else "tokens differ"))
        monkeypatch.setattr(routegate, "run_route", run_route)


def run_change(tmp_path, route=GATE, handlers=({"name": "restart sglang", "command": "true"},)):
    (tmp_path / "hosts.yaml").write_text("all:\n  hosts:\n    here:\n      ansible_connection: local\n")
    host = inventory.load(tmp_path / "hosts.yaml").select("here")[0]
    ctx = HostContext(host, None, time.monotonic() + 600)
    facts = {"servers": [{"pid": 7, "port": 30000, "host": "127.0.0.1", "python": "/usr/bin/python3"}]}
    change = Change("c1", "route-verify-attention", [], facts, "/x", list(handlers),
                    gates=[SmokeGate()] + ([route] if route is not None else []))
    return execute(ctx, HostResult("here", "local", HostStatus.OK), change, ChangeOptions())


def test_the_engine_takes_the_baseline_before_the_write_and_commits_a_passing_gate(tmp_path, monkeypatch):
    p = Probe(monkeypatch, [BASE, answer(server())])
    r = run_change(tmp_path)
    assert (r.status, p.actions, p.routes) == (HostStatus.CHANGED, ["apply", "commit"], 2)
    assert r.data["route_gate"]["status"] == "passed" and r.data["route_gate"]["runs"]["after"]["servers"]
    assert {c["name"] for c in r.data["route_gate"]["checks"]} == set(routegate.CHECKS)
    # the shape of the golden outputs' "route_gate": the options as they were, no reason when it ran
    assert list(r.data["route_gate"]) == ["status", "checks", "message", "token_drift", "options", "runs"]
    assert list(r.data["route_gate"]["options"]) == ["max_new_tokens", "long_tokens", "logprob_tolerance",
                                                     "near_tie", "accept_tolerance", "health_timeout"]


def test_the_engine_rolls_back_a_failing_gate(tmp_path, monkeypatch):
    after = answer(server(after=[entry(7, eager=0)]))
    p = Probe(monkeypatch, [BASE, after])
    r = run_change(tmp_path)
    assert (r.status, p.actions) == (HostStatus.FAILED, ["apply", "rollback"])
    assert r.error.startswith("rolled back: route gate failed: 127.0.0.1:30000 ranks FAILED: 0 of 1 expected ranks")
    assert r.data["rolled_back"] is True and r.data["route_gate"]["status"] == "failed"


def test_a_second_kernel_package_on_a_hooked_host_fails_its_route_gate_and_is_rolled_back(tmp_path, monkeypatch):
    """Deploy arms the route gate of the package it activates on a host whose install has the hook
    (kbuild state's "hooked"); the hook routes verify_attention's build, so the evidence after the
    restart names that build, not the new package's: the gate fails and the activation is put back."""
    from fleetctl.engine.kernels.deploy import DeployOptions, deploy_gates

    other_key = "9f" * 32
    gates = deploy_gates("paged_attention", other_key, True, DeployOptions())
    assert [g.name for g in gates] == ["validation", "route_gate"] and gates[1] == RouteGate("paged_attention", other_key)
    assert [g.name for g in deploy_gates("paged_attention", other_key, False, DeployOptions())] == ["validation"]
    p = Probe(monkeypatch, [BASE, answer(server())])  # the hook routed verify_attention's build (BUILD)
    r = run_change(tmp_path, route=gates[1])
    assert (r.status, p.actions, r.data["route_gate"]["status"]) == (HostStatus.FAILED, ["apply", "rollback"], "failed")
    assert f"pid 7 serves build {BUILD}, not /var/lib/fleetctl-kernels/paged_attention/{other_key}" in r.error


def test_the_engine_refuses_a_host_whose_baseline_fails_and_writes_nothing(tmp_path, monkeypatch):
    p = Probe(monkeypatch, [answer(server(ok=False, error="health deadline exceeded after 60 s: last answer HTTP 503"))])
    with pytest.raises(HostFailed, match="baseline route check failed: not changing this host: route 127.0.0.1:30000: "
                                         "health deadline exceeded"):
        run_change(tmp_path)
    assert p.actions == []


def test_no_route_gate_after_a_failed_smoke_gate_nor_without_the_step(tmp_path, monkeypatch):
    p = Probe(monkeypatch, [BASE, answer(server())], smoke_ok=False)
    r = run_change(tmp_path)
    assert (r.status, p.actions, p.routes) == (HostStatus.FAILED, ["apply", "rollback"], 1)
    assert "route_gate" not in r.data
    p = Probe(monkeypatch, [])
    r = run_change(tmp_path, route=None)
    assert (r.status, p.routes) == (HostStatus.CHANGED, 0) and "route_gate" not in r.data


def test_a_change_that_restarts_nothing_skips_every_server_gate_by_one_rule(tmp_path, monkeypatch):
    """No handler: the baselines were taken (a failing one would have refused the host), then
    every gate that judges a server says skipped (not restarted) and nothing is run after the write."""
    p = Probe(monkeypatch, [BASE])
    r = run_change(tmp_path, handlers=())
    assert (r.status, p.actions, p.routes) == (HostStatus.CHANGED, ["apply", "commit"], 1)
    not_restarted = {"status": "skipped", "reason": "not restarted: no fleetctl_restart_cmd"}
    assert r.data["validation"] == r.data["route_gate"] == not_restarted


def test_apply_arms_the_gates_of_the_plans_steps_with_the_build_the_hook_routes():
    """The playbook's route step gates the build the verify_attention_route finding's `current`
    names (the install's, read when the change was planned); the smoke step its own offline command."""
    from types import SimpleNamespace

    from fleetctl.engine.playbooks.apply import change_gates
    from fleetctl.engine.playbooks.model import load_playbook

    pb = load_playbook(ROOT / "playbooks" / "route-verify-attention.yaml")
    plan = SimpleNamespace(validate=[{"step": "compile"}, {"step": "smoke", "offline": "true"}, {"step": "route"}])
    inst = {"verify_attention_route": {"kernel": {"active": True, "current": KEY}}}
    gates = change_gates(pb, plan, inst, ChangeOptions())
    assert gates == [SmokeGate("true", []), RouteGate("verify_attention", KEY)] and gates[1].build == BUILD
    plan.validate = [{"step": "smoke"}]
    assert change_gates(pb, plan, inst, ChangeOptions()) == [SmokeGate()]


def test_the_report_shows_each_check(tmp_path):
    import io

    from rich.console import Console

    from fleetctl.report import gates as report
    data = {"route_gate": {**compare_route(BASE, answer(server(after=[entry(7)])), build=BUILD).to_dict()}}
    out = io.StringIO()
    report.render_route_gate([HostResult("here", "local", HostStatus.FAILED, data=data),
                              HostResult("other", "x", HostStatus.CHANGED, data={"route_gate": {"status": "skipped"}})],
                             Console(file=out, width=200))
    text = out.getvalue()
    assert "here: route gate failed" in text and "FAILED" in text and "0 of 1 expected ranks" in text
    assert "long prompt" in text and "accept length" in text and "other: route gate skipped" in text


def test_the_probe_constants_are_the_designs():
    assert routecheck.FLUSH_WAIT_S == 1.0 and routecheck.LONG_TOKENS == 4096 and routecheck.MAX_EVIDENCE == 64 << 10
    assert routegate.evidence_dir() == "/var/lib/fleetctl-kernels/route-evidence"
    o = RouteOptions()
    assert (o.logprob_tolerance, o.near_tie, o.accept_tolerance, o.max_new_tokens) == (0.02, 0.02, 0.05, 24)
