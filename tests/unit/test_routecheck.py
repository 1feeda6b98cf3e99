"""The route check probe (probes/traffic/routecheck.py) against a tiny SGLang-shaped HTTP server on
loopback (real sockets) and routing evidence in temp directories (real files, real /proc): what it
sends, what it reads from /generate and /server_info, the long prompt, and every way an evidence
file is refused (a link, another owner, a writable directory, too big, not the hook's fields, a
record of another process)."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading

import pytest

from fleetctl import probes
from fleetctl.probes.traffic import routecheck

UID = os.getuid()


class Fake:
    """An SGLang-shaped server: byte-level prompt_tokens (or `chars_per_token` chars a token, as a
    real tokenizer makes fewer), greedy ids from the prompt's length, SGLang's logprob shapes, and,
    per /generate, the evidence record of `pid` in `evidence` grown by one eager routed call (the
    hook's write). Answers 401 without `key` when one is set."""

    def __init__(self, evidence=None, pid=None, context=8192, chars_per_token=1, key=None, speculative="NGRAM"):
        self.evidence, self.pid, self.context, self.cpt, self.key = evidence, pid, context, chars_per_token, key
        self.speculative = speculative
        self.requests, self.routed = [], 0
        fake = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def reply(self, status, body):
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def authorized(self):
                if fake.key and self.headers.get("Authorization") != "Bearer " + fake.key:
                    self.reply(401, {"error": "unauthorized"})
                    return False
                return True

            def do_GET(self):
                if self.path == "/health":
                    return self.reply(200, {})
                if self.path == "/server_info" and self.authorized():
                    return self.reply(200, {"tp_size": 1, "pp_size": 1, "dp_size": 1, "enable_dp_attention": False,
                                            "nnodes": 1, "context_length": fake.context,
                                            "speculative_algorithm": fake.speculative,
                                            "speculative_num_draft_tokens": 4 if fake.speculative else None})
                return self.reply(404, {"detail": "Not Found"})

            def do_POST(self):
                if not self.authorized():
                    return
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(req)
                n = req["sampling_params"]["max_new_tokens"]
                pt = -(-len(req["text"].encode()) // fake.cpt)
                if pt + n > fake.context:
                    return self.reply(400, {"error": "too long"})
                ids = [(pt * 7 + i * 13) % 500 for i in range(n)]
                fake.routed += 1
                fake.write_evidence()
                self.reply(200, {"text": "x", "output_ids": ids, "meta_info": {
                    "prompt_tokens": pt, "completion_tokens": n, "spec_verify_ct": n // 2 if fake.speculative else 0,
                    "output_token_logprobs": [[-0.1 * (i % 3), t, None] for i, t in enumerate(ids)],
                    "output_top_logprobs": [[[-0.1 * (i % 3), t, None], [-1.5, t + 1, None]] for i, t in enumerate(ids)]}})

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def write_evidence(self):
        if self.evidence is None:
            return
        write(self.evidence, self.pid, record(self.pid, eager_routed=self.routed))

    def target(self):
        return {"pid": self.pid, "host": "127.0.0.1", "port": self.port, "node_rank": 0}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def record(pid, **over):
    """An evidence record of live process `pid` as the hook writes it (its docstring + uid)."""
    rec = {"pid": pid, "uid": UID, "start_time": routecheck.start_time(pid), "boot_id": routecheck.boot_id(),
           "build": "/var/lib/fleetctl-kernels/x/k",
           "module": "/var/lib/fleetctl-kernels/x/k/build/m.so", "captured": [], "eager_routed": 0,
           "fallbacks": {"shape not enabled": 2}, "written": 1.0, "trigger": "eager"}
    rec.update(over)
    return rec


def write(directory, pid, rec, raw=None):
    d = os.path.join(directory, str(UID))
    os.makedirs(d, mode=0o755, exist_ok=True)
    os.chmod(d, 0o755)
    path = os.path.join(d, "%d.json" % pid)
    with open(path + ".tmp", "wb") as f:
        f.write(raw if raw is not None else json.dumps(rec).encode())
    os.replace(path + ".tmp", path)
    return path


@pytest.fixture
def ev(tmp_path):
    d = tmp_path / "route-evidence"
    d.mkdir()
    return str(d)


@pytest.fixture
def child():
    """A live process of ours (its evidence is a real /proc entry's)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p.pid
    p.kill()
    p.wait()


# ---- evidence ------------------------------------------------------------------------------

def test_a_fresh_record_is_read_with_its_fields(ev, child):
    write(ev, child, record(child, eager_routed=5, captured=[{"batch": 1, "draft_tokens": 4, "head_dim": 64,
                                                             "group": 2, "dtype": "float32"}]))
    e = routecheck.read_evidence(ev, child)
    assert (e["state"], e["uid"], e["start_time"]) == ("fresh", UID, routecheck.start_time(child))
    assert e["record"]["eager_routed"] == 5 and e["record"]["captured"][0]["batch"] == 1
    assert e["record"]["fallbacks"] == {"shape not enabled": 2}


def test_start_time_is_stat_field_22(child):
    with open("/proc/%d/stat" % child) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    assert routecheck.start_time(child) == int(fields[19]) and routecheck.start_time(child) > 0
    # field 22 is the 20th after the name: state (3), ppid (4), ..., starttime (22)
    assert int(fields[1]) == os.getpid()


def test_a_record_of_another_process_with_the_pid_is_stale(ev, child):
    write(ev, child, record(child, start_time=routecheck.start_time(child) - 1, eager_routed=9))
    e = routecheck.read_evidence(ev, child)
    assert e["state"] == "stale" and "start_time" in e["why"]
    write(ev, child, record(child, uid=UID + 1))
    assert routecheck.read_evidence(ev, child)["state"] == "stale"


def test_a_record_of_another_boot_is_stale(ev, child):
    """Review R4-8: after a reboot a process may have an earlier one's pid and start tick; the
    record names its boot (and one of a hook that wrote none names no boot)."""
    assert len(routecheck.boot_id()) == 36
    write(ev, child, record(child, boot_id="0" * 8 + routecheck.boot_id()[8:]))
    e = routecheck.read_evidence(ev, child)
    assert e["state"] == "stale" and "is of boot 00000000" in e["why"], e
    write(ev, child, record(child, boot_id=None))
    assert routecheck.read_evidence(ev, child)["state"] == "stale"
    write(ev, child, record(child))
    assert routecheck.read_evidence(ev, child)["state"] == "fresh"


def test_a_missing_record_and_a_gone_process(ev, child):
    assert routecheck.read_evidence(ev, child)["state"] == "missing"
    assert routecheck.read_evidence(ev + "/nothing", child)["state"] == "missing"
    p = subprocess.Popen(["true"])
    p.wait()
    assert routecheck.read_evidence(ev, p.pid)["state"] == "gone"


def test_a_linked_evidence_file_is_refused_not_followed(ev, child, tmp_path):
    good = tmp_path / "elsewhere.json"
    good.write_text(json.dumps(record(child, eager_routed=3)))
    d = os.path.join(ev, str(UID))
    os.makedirs(d, 0o755)
    os.symlink(good, os.path.join(d, "%d.json" % child))
    e = routecheck.read_evidence(ev, child)
    assert e["state"] == "refused" and "symbolic link" in e["why"] and e["record"] is None


def test_a_linked_uid_directory_and_a_linked_evidence_dir_are_refused(ev, child, tmp_path):
    real = tmp_path / "real"
    write(str(real), child, record(child))
    os.symlink(real / str(UID), os.path.join(ev, str(UID)))
    assert routecheck.read_evidence(ev, child)["state"] == "refused"
    os.symlink(real, tmp_path / "linked")
    e = routecheck.read_evidence(str(tmp_path / "linked"), child)
    assert e["state"] == "refused" and "symlink" in e["why"]


def test_another_owner_a_writable_directory_a_fifo_and_a_big_file_are_refused(ev, child):
    path = write(ev, child, record(child))
    for mode in (0o777, 0o775):  # others, or the group alone
        os.chmod(os.path.dirname(path), mode)
        assert "writable by group or others (mode %o)" % mode in routecheck.read_evidence(ev, child)["why"]
    os.chmod(os.path.dirname(path), 0o755)
    if UID == 0:
        os.chown(path, 65534, 65534)
        e = routecheck.read_evidence(ev, child)
        assert e["state"] == "refused" and "uid 65534" in e["why"]
        os.chown(path, 0, 0)
        os.chown(os.path.dirname(path), 65534, 65534)
        assert "uid 65534" in routecheck.read_evidence(ev, child)["why"]
        os.chown(os.path.dirname(path), 0, 0)
    assert routecheck.read_evidence(ev, child)["state"] == "fresh"
    write(ev, child, None, raw=json.dumps(record(child, pad="x" * (64 << 10))).encode())
    assert "over" in routecheck.read_evidence(ev, child)["why"]
    os.unlink(path)
    os.mkfifo(path)  # opened O_NONBLOCK: never hangs
    assert "FIFO" in routecheck.read_evidence(ev, child)["why"]


@pytest.mark.parametrize("bad,field", [({"eager_routed": "5"}, "eager_routed"), ({"eager_routed": -1}, "eager_routed"),
                                       ({"start_time": True}, "start_time"), ({"captured": {}}, "captured"),
                                       ({"captured": [{"batch": 1}]}, "captured"), ({"fallbacks": []}, "fallbacks"),
                                       ({"uid": None}, "uid")])
def test_records_not_of_the_hooks_shape_are_refused(ev, child, bad, field):
    write(ev, child, record(child, **bad))
    e = routecheck.read_evidence(ev, child)
    assert e["state"] == "refused" and field in e["why"]


def test_not_json_and_not_an_object_are_refused(ev, child):
    write(ev, child, None, raw=b"{not json")
    assert "not JSON" in routecheck.read_evidence(ev, child)["why"]
    write(ev, child, None, raw=b"[" * 60000)  # past the parser's depth: refused, never raised
    assert "not JSON" in routecheck.read_evidence(ev, child)["why"]
    write(ev, child, None, raw=b"[1, 2]")
    assert "not a JSON object" in routecheck.read_evidence(ev, child)["why"]


def test_host_strings_and_lists_are_bounded(ev, child):
    write(ev, child, record(child, build="b" * 5000, captured=[{"batch": i, "draft_tokens": 4, "head_dim": 64,
                                                                "group": 2, "dtype": "float32"} for i in range(400)],
                             fallbacks={"r%d" % i: 1 for i in range(100)}))
    rec = routecheck.read_evidence(ev, child)["record"]
    assert len(rec["build"]) == routecheck.MAX_STR and len(rec["captured"]) == routecheck.MAX_CAPTURED
    assert rec["captured_total"] == 400 and len(rec["fallbacks"]) == routecheck.MAX_FALLBACKS


def test_the_tree_holds_the_server_and_its_descendants_with_records(ev, child):
    write(ev, child, record(child, eager_routed=1))
    me = os.getpid()
    entries = routecheck.tree_evidence(ev, me)
    assert [e["pid"] for e in entries][:1] == [me] and entries[0]["state"] == "missing"
    assert [e["state"] for e in entries if e["pid"] == child] == ["fresh"]
    assert me not in routecheck.process_tree(child)


# ---- the requests --------------------------------------------------------------------------

def test_the_long_text_is_deterministic():
    assert routecheck.long_text(5000) == routecheck.long_text(5000) and len(routecheck.long_text(5000)) == 5000
    assert routecheck.long_text(9000).startswith(routecheck.long_text(5000))


def checked(fake, ev, **kw) -> dict:
    """routecheck.route_server of `fake`'s target (health 10 s, no flush wait, 8 new tokens, or `kw`), `fake` closed after."""
    try:
        return routecheck.route_server(fake.target(), ev, **{"health_timeout": 10, "flush_wait_s": 0.0,
                                                             "max_new_tokens": 8, **kw})
    finally:
        fake.close()


def test_route_server_sends_greedy_logprob_requests_and_reads_the_evidence_twice(ev, child):
    fake = Fake(ev, child)
    res = checked(fake, ev)
    assert res["ok"], res["error"]
    assert len(fake.requests) == len(routecheck.PROMPTS) + 1
    for req in fake.requests:
        assert req["return_logprob"] is True and req["top_logprobs_num"] == 2
        assert req["sampling_params"] == {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    long = res["prompts"][-1]
    assert long["name"] == "long" and long["prompt_tokens"] >= 4096 and long["tries"] == 1
    assert res["server_info"]["speculative_num_draft_tokens"] == 4
    p = res["prompts"][0]
    assert len(p["output_ids"]) == 8 and p["logprobs"][1] == pytest.approx(-0.1) and p["top2"][0][1][0] == -1.5
    assert p["spec_verify_ct"] == 4 and p["completion_tokens"] == 8
    before = {e["pid"]: e for e in res["evidence"]["before"]}
    after = {e["pid"]: e for e in res["evidence"]["after"]}
    assert child not in before or before[child]["state"] == "missing"
    assert after[child]["state"] == "fresh" and after[child]["record"]["eager_routed"] == 4


def test_the_before_read_waits_for_the_calls_of_what_ran_before_to_be_written(ev, child):
    """The smoke gate's 40 routed calls, written by the hook's thread 0.2 s after they ended: the
    before read waits flush_wait_s, so they are not counted as the check's own."""
    fake = Fake(ev, child)
    fake.routed = 40
    late = threading.Timer(0.2, fake.write_evidence)
    late.start()
    try:
        res = routecheck.route_server(fake.target(), ev, health_timeout=10, flush_wait_s=0.6, max_new_tokens=8)
    finally:
        late.cancel()
        fake.close()
    before = {e["pid"]: e for e in res["evidence"]["before"]}
    after = {e["pid"]: e for e in res["evidence"]["after"]}
    assert before[child]["record"]["eager_routed"] == 40 and after[child]["record"]["eager_routed"] == 44


def test_the_long_prompt_grows_when_the_tokenizer_makes_fewer_tokens(ev):
    fake = Fake(chars_per_token=4)
    res = checked(fake, ev)
    long = res["prompts"][-1]
    assert res["ok"] and long["tries"] == 2 and long["prompt_tokens"] >= 4096, long
    assert long["prompt_tokens"] + 8 <= 8192


def test_a_server_that_counts_almost_no_tokens_never_makes_the_prompt_grow_without_bound(ev):
    fake = Fake(chars_per_token=10 ** 6, context=10 ** 9)  # prompt_tokens 1, whatever is sent
    res = checked(fake, ev)
    long = res["prompts"][-1]
    limit = routecheck.MAX_CHARS_PER_TOKEN * 4096 + 64
    assert not res["ok"] and long["chars"] == limit and long["tries"] == 2, long  # at the limit: not sent again
    assert f"at most {limit} sent), fewer than 4096" in long["error"]
    assert max(len(r.get("text", "")) for r in fake.requests) == limit


def test_a_context_too_short_for_the_long_prompt_fails_it_saying_so(ev):
    fake = Fake(context=4096)
    res = checked(fake, ev)
    assert not res["ok"] and "context_length 4096 cannot hold a 4096-token prompt" in res["error"]
    assert len(fake.requests) == len(routecheck.PROMPTS)  # not sent


def test_an_unhealthy_or_non_zero_rank_target_is_not_decoded(ev):
    fake = Fake()
    port = fake.port
    fake.close()
    res = routecheck.route_server({"pid": None, "host": "127.0.0.1", "port": port, "node_rank": 0}, ev,
                                  health_timeout=0.3, flush_wait_s=0.0)
    assert not res["ok"] and "health deadline" in res["error"]
    fake = Fake()
    try:
        res = routecheck.route_server(dict(fake.target(), node_rank=1), ev, health_timeout=5, flush_wait_s=0.0)
    finally:
        fake.close()
    assert not res["ok"] and "node rank 1" in res["error"] and fake.requests == []


def test_answers_without_logprobs_or_of_another_length_are_errors():
    ok = {"output_ids": [1, 2], "meta_info": {"prompt_tokens": 3, "completion_tokens": 2,
                                              "output_token_logprobs": [[-0.1, 1, None], [-0.2, 2, None]],
                                              "output_top_logprobs": [[[-0.1, 1, None]], [[-0.2, 2, None]]]}}
    assert routecheck.parse_answer(200, ok, 2)["error"] is None
    assert "logprobs" in routecheck.parse_answer(200, {"output_ids": [1, 2], "meta_info": {"prompt_tokens": 3}}, 2)["error"]
    assert "expected 3" in routecheck.parse_answer(200, ok, 3)["error"]
    assert "HTTP 500" in routecheck.parse_answer(500, {"error": "x"}, 2)["error"]
    weird = {"output_ids": "no", "meta_info": {"prompt_tokens": "3", "output_token_logprobs": [["nan?", 1]],
                                               "output_top_logprobs": [None]}}
    p = routecheck.parse_answer(200, weird, 1)
    assert p["output_ids"] is None and p["prompt_tokens"] is None and p["logprobs"] == [None] and p["top2"] == [[]]


def test_the_bundle_runs_as_on_a_host_sends_the_api_key_and_returns_no_secret(ev, tmp_path):
    """main() through the real WRAPPER: the probe's imports make its bundle; the target is this test
    process (it holds the fake's listening socket), picked as every probe picks one."""
    fake = Fake(ev, os.getpid(), key="s3cret-key")
    params = {"servers": [{"pid": os.getpid(), "port": fake.port, "host": "127.0.0.1"}], "api_key": "s3cret-key",
              "evidence_dir": ev, "health_timeout": 10, "flush_wait_s": 0.2, "max_new_tokens": 4}
    try:
        r = subprocess.run([sys.executable, "-S", "-c", probes.WRAPPER],
                           input=json.dumps(probes.document("traffic.routecheck", params)).encode(),
                           capture_output=True, timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
        out = probes.parse_output(r.stdout, r.stderr, r.returncode)
    finally:
        fake.close()
    s, = out["servers"]
    assert s["ok"], (s["error"], out)
    assert [e["state"] for e in s["evidence"]["after"] if e["pid"] == os.getpid()] == ["fresh"]
    assert "s3cret-key" not in json.dumps(out)
