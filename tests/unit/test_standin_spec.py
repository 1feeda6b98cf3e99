"""The lab stand-in's speculative decoding, KV pool and logprobs (agent/fleetctl/lab/standin/engine.py):
greedy speculation is lossless (the same tokens as plain decoding, a 4,200-token prompt included),
the STANDALONE draft is accepted, the verify's attention goes through an installed
sglang/srt/layers/attention/fleetctl_verify.py found by path and called with SGLang's
target-verify keywords and the drafts' chain as its custom_mask (a hook that answers False
leaves it to the stand-in; one that computes it wrong, or only its first row right, changes the
tokens), and the logprobs are those of the rows that picked the tokens."""

from __future__ import annotations

import importlib
import textwrap

import pytest

from fleetctl.lab import standin
from helpers.lab import load_standin

GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
SHORT = list(b"hello world, hello world, ")
LONG = list((b"the cat sat on the mat. " * 180)[:4200])

# A hook written as the playbook's would be called: SGLang's Triton-backend keywords, the target
# verify computed in plain torch from them (the prefix through kv_indices, the drafts from
# k_extend/v_extend, the chain from custom_mask), the calls and keywords recorded.
HOOK = '''
import torch
CALLS = []
MASKS = []  # (P, T, custom_mask) of each call
MODE = {mode!r}


def verify_fwd(**kw):
    CALLS.append({{k: (str(v.dtype), tuple(v.shape)) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}})
    if MODE == "decline":
        return False
    q, P, T = kw["q_extend"], int(kw["kv_indptr"][1]), kw["max_len_extend"]
    keys = torch.cat([kw["k_buffer"][kw["kv_indices"]], kw["k_extend"]])
    vals = torch.cat([kw["v_buffer"][kw["kv_indices"]], kw["v_extend"]])
    if MODE == "swapped":  # the wrong head mapping: query head h reads KV head h % Hkv
        keys, vals = keys.repeat(1, 2, 1), vals.repeat(1, 2, 1)
    else:
        keys, vals = keys.repeat_interleave(2, dim=1), vals.repeat_interleave(2, dim=1)
    MASKS.append((P, T, kw["custom_mask"].clone()))
    mask = kw["custom_mask"][: T * (P + T)].view(T, P + T)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1),
                                                         vals.transpose(0, 1), attn_mask=mask, scale=kw["sm_scale"])
    kw["o_extend"].copy_(o.transpose(0, 1))
    if MODE == "first_row":  # only the first row right: every draft row gets the first row's output
        kw["o_extend"][1:] = kw["o_extend"][0]
    return True
'''


@pytest.fixture(scope="module")
def engine():
    return load_standin(standin.ENGINE)


@pytest.fixture(scope="module")
def plain(engine):
    """Plain greedy output_ids and logprob info of SHORT and LONG."""
    e = engine.Engine(0, {})
    return {name: e.generate(p, GREEDY, logprobs={"top": 2, "start": -1}) for name, p in (("short", SHORT), ("long", LONG))}


def installed_hook(tmp_path, monkeypatch, engine, mode):
    """A fake SGLang install on sys.path holding the hook (mode: "serve", "decline", "swapped",
    "first_row");
    load_verify_hook's answer for the Triton backend."""
    d = tmp_path / mode / "sglang"
    (d / "srt" / "layers" / "attention").mkdir(parents=True)
    (d / "__init__.py").write_text("raise ImportError('a no-deps install: sglang cannot be imported here')\n")
    (d / "srt" / "layers" / "attention" / "fleetctl_verify.py").write_text(textwrap.dedent(HOOK.format(mode=mode)))
    monkeypatch.syspath_prepend(str(tmp_path / mode))
    importlib.invalidate_caches()
    return engine.load_verify_hook("triton")


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_speculation_is_lossless_on_a_long_prompt_too(engine, plain, algorithm):
    spec = engine.Engine(0, {}, draft_tokens=4, algorithm=algorithm)
    for name, prompt in (("short", SHORT), ("long", LONG)):
        ids, finish, info = spec.generate(prompt, GREEDY, logprobs={"top": 2, "start": -1})
        assert ids == plain[name][0] and finish == plain[name][1], (algorithm, name)
        assert info["spec_verify_ct"] >= 1
        assert len(spec.pool.free_slots) == spec.pool.size  # rejected drafts' slots and the request's freed
        lp = [x[0] for x in info["output_token_logprobs"]]
        assert max(abs(a - b[0]) for a, b in zip(lp, plain[name][2]["output_token_logprobs"])) < 1e-4
    assert spec.pool.calls["verify_own"] > 0 and spec.pool.calls["verify_hook"] == 0


def test_the_standalone_draft_is_accepted_and_reported_as_sglang_does(engine):
    spec = engine.Engine(0, {}, draft_tokens=4, algorithm="STANDALONE")
    ids, finish, info = spec.generate(LONG, GREEDY)
    out_dict = load_standin().out_dict  # server.py's: the metrics as SGLang reports them
    meta = out_dict("r", LONG, ids, finish, info)["meta_info"]
    assert meta["spec_verify_ct"] < meta["completion_tokens"] == 24  # drafts were accepted
    assert meta["spec_accept_length"] == pytest.approx(24 / meta["spec_verify_ct"])
    assert meta["spec_num_proposed_drafts"] == 3 * meta["spec_verify_ct"]
    assert meta["spec_accept_rate"] == pytest.approx(meta["spec_num_correct_drafts"] / meta["spec_num_proposed_drafts"])
    plain_meta = out_dict("r", LONG, ids, finish, engine.Engine(0, {}).generate(LONG, GREEDY)[2])["meta_info"]
    assert "spec_verify_ct" not in plain_meta  # SGLang adds them only for a verified request


def test_verify_goes_through_the_installed_hook_with_sglangs_keywords(engine, plain, tmp_path, monkeypatch):
    fwd, said = installed_hook(tmp_path, monkeypatch, engine, "serve")
    assert fwd is not None and "fleetctl_verify.py" in said
    calls = fwd.__globals__["CALLS"]
    spec = engine.Engine(0, {}, draft_tokens=4, verify=fwd, algorithm="STANDALONE")
    for name, prompt in (("short", SHORT), ("long", LONG)):
        assert spec.generate(prompt, GREEDY)[0] == plain[name][0], name
    assert spec.pool.calls["verify_own"] == 0 and spec.pool.calls["verify_hook"] == len(calls) > 0
    kw = calls[-1]
    assert kw["q_extend"] == ("torch.float32", (4, 4, 64)) and kw["k_extend"] == ("torch.float32", (4, 2, 64))
    assert kw["k_buffer"][0] == "torch.float32" and kw["k_buffer"][1][1:] == (2, 64)
    assert (kw["qo_indptr"][0], kw["kv_indptr"][0], kw["kv_indices"][0], kw["mask_indptr"][0], kw["custom_mask"][0]) == (
        "torch.int32", "torch.int32", "torch.int64", "torch.int64", "torch.bool")
    assert (kw["is_causal"], kw["max_len_extend"], kw["logit_cap"], kw["page_size"]) == (True, 4, 0.0, 1)


def test_the_verify_mask_is_the_drafts_chain_and_its_rows_are_used(engine, plain, tmp_path, monkeypatch):
    fwd, _ = installed_hook(tmp_path, monkeypatch, engine, "serve")
    spec = engine.Engine(0, {}, draft_tokens=4, verify=fwd, algorithm="STANDALONE")
    spec.generate(SHORT, GREEDY)
    import torch
    for P, T, mask in fwd.__globals__["MASKS"]:
        assert mask.shape == (T * (P + T),)
        m = mask.view(T, P + T)
        assert m[:, :P].all() and torch.equal(m[:, P:], torch.ones(T, T, dtype=torch.bool).tril()), (P, T, m)
    bad, _ = installed_hook(tmp_path, monkeypatch, engine, "first_row")
    spec = engine.Engine(0, {}, draft_tokens=4, verify=bad, algorithm="STANDALONE")
    assert spec.generate(LONG, GREEDY)[0] != plain["long"][0]  # rows past the first feed the tokens


def test_a_hook_that_declines_leaves_the_verify_to_the_stand_in(engine, plain, tmp_path, monkeypatch):
    fwd, _ = installed_hook(tmp_path, monkeypatch, engine, "decline")
    spec = engine.Engine(0, {}, draft_tokens=4, verify=fwd, algorithm="STANDALONE")
    assert spec.generate(SHORT, GREEDY)[0] == plain["short"][0]
    assert spec.pool.calls["verify_hook"] == 0 and spec.pool.calls["verify_own"] == len(fwd.__globals__["CALLS"]) > 0


def test_a_hook_with_the_wrong_head_mapping_changes_the_tokens(engine, plain, tmp_path, monkeypatch):
    fwd, _ = installed_hook(tmp_path, monkeypatch, engine, "swapped")
    spec = engine.Engine(0, {}, draft_tokens=4, verify=fwd, algorithm="STANDALONE")
    assert spec.generate(SHORT, GREEDY)[0] != plain["short"][0]


def test_no_hook_without_the_triton_backend_or_the_file(engine, tmp_path, monkeypatch):
    assert engine.load_verify_hook("flashinfer")[0] is None and engine.load_verify_hook(None)[0] is None
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    fwd, said = engine.load_verify_hook("triton")
    assert fwd is None and "fleetctl_verify.py" in said and "own verify attention" in said


def test_logprobs_are_the_picking_rows(engine, plain):
    ids, _, info = plain["short"]
    for token, lp, top in zip(ids, info["output_token_logprobs"], info["output_top_logprobs"]):
        assert lp[1] == token and lp[2] is None and len(top) == 2
        assert top[0][1] == token and top[0][0] == pytest.approx(lp[0]) and top[0][0] >= top[1][0]
    assert info["input_token_logprobs"][-1][1] == SHORT[-1] and len(info["input_token_logprobs"]) == 1
