"""The lab stand-in's model half: the tiny model, its KV pool and the decoding Engine that
server.py (beside this file) serves over HTTP. This is not SGLang.

A tiny decoder-only transformer in torch (seeded weights, CPU): tokens are deterministic and
latency is real. Its attention is grouped-query (4 query heads, 2 KV heads of head dim 64: a
shape the verify_attention kernel's CPU backend serves) over a paged KV pool in SGLang's layout
(KVPool: per-layer k_buffer / v_buffer [slots, 2, 64], slot 0 the dummy, a free list), context
8,192 tokens. The tokenizer is byte-level (encode, decode): id i = byte i, 256 `<eos>`,
257..511 reserved special tokens (server.py's tokenizer/ files say the same to SGLang's clients).

Speculative decoding (`--speculative-algorithm NGRAM`: a prompt-lookup draft; `STANDALONE`: a
draft model, here this model's first block and head; `--speculative-num-draft-tokens T`, default
4) is greedy and lossless: a target-verify step over [last token, T-1 drafts] accepts the drafts
the target agrees with, plus its own next token. With `--attention-backend triton` the verify's
attention goes through the installed SGLang's `fleetctl_verify.verify_fwd` (what fleetctl's
route-verify-attention playbook creates), loaded by file path and called with the keywords
SGLang's Triton backend passes to extend_attention_fwd (KVPool.verify_args); where that file is
absent, or verify_fwd answers False, the stand-in's own attention runs. Engine.generate returns
SGLang's speculative counts (server.py's out_dict turns them into spec_verify_ct,
spec_accept_length, ...), and with logprobs asked for its logprob keys (Engine._logprobs).

The MoE model (`--model-path fleetctl-standin/tiny-moe`, MOE_MODEL): the same, with each block's
MLP a mixture of EXPERTS experts (a router, top-TOPK of a softmax, renormalized; each expert a
SiLU-gated MLP), whose per-pass expert counts SGLang's expert distribution recorder records
(instruments.py); the default model stays dense (and its tokens the same).

Each "device kernel" of a forward pass runs inside torch.profiler.record_function(NAME), NAME a
kernel of SGLang's own source (KERNELS), so that a torch profiler trace of the stand-in
(instruments.Profiler) names the kernels a GPU trace of SGLang would; the aten ops inside a
region are its CPU implementation, and the dense GEMMs (q/kv/o projections, the router gate, the
LM head) are the plain aten::linear ops outside any region, as SGLang's unquantized layers call
F.linear. Regions never nest one another. Forward passes run on one scheduler thread
(Engine.on_scheduler: the profiler records the thread that started it only), and count
Engine.forward_ct as SGLang's scheduler counts its batches.

Faults (the behaviour file's keys, read each pass; server.py's docstring lists them all):
  {"hot_expert": {"layer": L, "expert": E}}  the MoE router of layer L adds HOT_BIAS to expert
      E's logit: E is in every token's top-k there (it gets tokens / (tokens * TOPK) = 1/TOPK of
      that layer's assignments, against 1/EXPERTS when balanced), and so is the rank holding it
      (E // (EXPERTS / ep_size)); the MoE model only
  {"slow_attention_ms": M}  every attention kernel region (decode, extend, verify) takes M ms
      longer (slept inside the region, so a trace shows it in the attention kernels)

Stdlib + torch (imported when a model is built) only; never imports fleetctl (it is copied with
server.py onto lab hosts).
"""

import contextlib
import os
import threading
import time

VOCAB, DIM, LAYERS, CONTEXT = 512, 256, 2, 8192
# grouped-query attention of a shape the verify_attention kernel's CPU backend serves
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
EOS = 256  # ids 0..255 are bytes; 256.. are special ids (EOS) and never decode to text
SPECIAL_PENALTY = 6.0  # subtracted from the logits of the reserved ids 257.. (3.0 still left 16% of 160 tokens special)
MOE_MODEL = "fleetctl-standin/tiny-moe"  # the --model-path that serves the MoE model
EXPERTS, TOPK, MOE_DIM = 8, 2, 128  # routed experts per MoE layer, experts per token, expert MLP width
HOT_BIAS = 20.0  # added to the hot expert's router logit (hot_expert)
DECODE_LOG_INTERVAL = 40  # decode passes between SGLang's decode stats (ServerArgs.decode_log_interval)
# The device kernels of a forward pass (record_function names), by role. Each is a kernel or op
# of SGLang's source, the same names in 0.4.6.post5, 0.5.2, 0.5.10 and 0.5.23 (tests/unit/
# test_standin_instruments.py checks each against every release's wheel); paths 0.4.6.post5 / 0.5.23:
KERNELS = {
    # Triton decode attention, the grouped (GQA) stage 1 and the reduce stage 2:
    # srt/layers/attention/triton_ops/decode_attention.py:246,497 / kernels/ops/attention/decode_attention.py:530,935
    "attention_decode": ("_fwd_grouped_kernel_stage1", "_fwd_kernel_stage2"),
    # Triton extend attention, for a prefill and (with the drafts' custom mask) a target verify:
    # srt/layers/attention/triton_ops/extend_attention.py:42 / kernels/ops/attention/extend_attention.py:375
    "attention_extend": ("_fwd_kernel",),
    # the router's top-k (sgl_kernel topk_softmax: srt/layers/moe/topk.py:39 / kernels/ops/moe/__init__.py:171)
    # and the sort of tokens by expert (srt/layers/moe/fused_moe_triton/fused_moe.py:653 /
    # kernels/ops/moe/moe_align.py:38)
    "moe_route": ("topk_softmax", "moe_align_block_size"),
    # the Triton fused MoE GEMM, once up (w13) and once down (w2), and the activation between:
    # srt/layers/moe/fused_moe_triton/fused_moe.py:307 / kernels/ops/moe/fused_moe_triton_kernels.py:322;
    # sgl_kernel silu_and_mul (fused_moe.py:39 / kernels/ops/activation/activation.py:228)
    "moe_experts": ("fused_moe_kernel", "silu_and_mul"),
    # tensor-parallel all-reduce after the attention output and the MoE, with --tp-size > 1 only
    # (the custom op registered by srt/distributed/parallel_state.py:126 / :195)
    "all_reduce": ("sglang::outplace_all_reduce",),
    # sampling a non-greedy token (srt/layers/sampler.py); a greedy one is torch.argmax, as there
    "sampling": ("top_k_top_p_sampling_from_probs",),
    # greedy acceptance of a target verify (sgl_kernel: srt/speculative/eagle_utils.py:35 /
    # kernels/ops/speculative/tree.py:61)
    "verify_accept": ("verify_tree_greedy",),
}


def region(torch, name):
    """torch.profiler.record_function(name) while a profiler records this thread, else a no-op
    context (a record_function region costs tens of microseconds even with none recording)."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


class BadRequest(ValueError):
    """A request the stand-in refuses with HTTP 400 (SGLang answers such with 400 too)."""


def encode(text):
    """Byte-level "tokenizer": UTF-8 bytes are the token ids 0..255."""
    return list(text.encode("utf-8"))


def decode(ids):
    """Inverse of encode; special ids (>= 256) decode to nothing, as with skip_special_tokens."""
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def build_model(seed, moe=False):
    """The tiny decoder-only transformer (seeded weights): LAYERS blocks of grouped-query attention
    (HEADS query heads, KV_HEADS KV heads of HEAD_DIM) reading and writing a KVPool, for CPU
    inference; with `moe` each block's MLP is a MoE layer (EXPERTS experts, top-TOPK).
    forward(ids, positions, pool, step) -> logits [t, VOCAB]."""
    import torch
    from torch import nn

    def record_function(name):
        return region(torch, name)

    def all_reduce(x, step):
        """The tensor-parallel all-reduce of a row-parallel output (a copy here: one process holds
        every rank's share), with --tp-size > 1 only, as SGLang skips it on one rank."""
        if step.ctx is None or step.ctx.tp_size <= 1:
            return x
        with record_function(KERNELS["all_reduce"][0]):
            return x.clone()

    class MoE(nn.Module):
        """A mixture of EXPERTS SiLU-gated experts, each token routed to its top TOPK (softmax
        weights renormalized over them), the way SGLang's fused MoE runs: router gate (dense),
        topk_softmax, moe_align_block_size (tokens sorted by expert), fused_moe_kernel (w13),
        silu_and_mul, fused_moe_kernel (w2, times the routing weights), then the sum per token."""

        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(DIM, EXPERTS, bias=False)
            self.w13 = nn.Parameter(torch.randn(EXPERTS, 2 * MOE_DIM, DIM) * DIM ** -0.5)
            self.w2 = nn.Parameter(torch.randn(EXPERTS, DIM, MOE_DIM) * MOE_DIM ** -0.5)

        def forward(self, x, layer, step):
            ctx = step.ctx
            logits = self.gate(x)
            with record_function("topk_softmax"):
                hot = ctx.hot if ctx is not None else None
                if hot is not None and hot[0] == layer:
                    logits = logits + HOT_BIAS * (torch.arange(EXPERTS) == hot[1])
                weights, ids = torch.softmax(logits, -1).topk(TOPK, -1)
                weights = weights / weights.sum(-1, keepdim=True)
            with record_function("moe_align_block_size"):
                flat = ids.flatten()
                order = flat.argsort(stable=True)
                per_expert = torch.bincount(flat, minlength=EXPERTS)
                rows = order // TOPK  # the token of each sorted (token, slot)
            if ctx is not None and ctx.counts is not None:
                ctx.counts[layer] += per_expert.to(torch.int32)
            spans, at = [], 0
            for e, n in enumerate(per_expert.tolist()):
                if n:
                    spans.append((e, at, at + n))
                    at += n
            with record_function("fused_moe_kernel"):
                xs = x[rows]
                h = torch.empty(at, 2 * MOE_DIM)
                for e, a, b in spans:
                    h[a:b] = xs[a:b] @ self.w13[e].T
            with record_function("silu_and_mul"):
                act = torch.nn.functional.silu(h[:, :MOE_DIM]) * h[:, MOE_DIM:]
            with record_function("fused_moe_kernel"):
                o = torch.empty(at, DIM)
                for e, a, b in spans:
                    o[a:b] = act[a:b] @ self.w2[e].T
                o = o * weights.flatten()[order, None]
            return torch.zeros_like(x).index_add_(0, rows, o)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
            self.q = nn.Linear(DIM, HEADS * HEAD_DIM)
            self.kv = nn.Linear(DIM, 2 * KV_HEADS * HEAD_DIM)
            self.proj = nn.Linear(HEADS * HEAD_DIM, DIM)
            if moe:
                self.moe = MoE()
            else:
                self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

        def forward(self, x, layer, pool, step):
            t = x.shape[0]
            h = self.ln1(x)
            q = self.q(h).view(t, HEADS, HEAD_DIM)
            k, v = self.kv(h).view(t, 2, KV_HEADS, HEAD_DIM).unbind(1)
            a = pool.attend(layer, q, k.contiguous(), v.contiguous(), step)
            x = x + all_reduce(self.proj(a.reshape(t, HEADS * HEAD_DIM)), step)
            if moe:
                return x + all_reduce(self.moe(self.ln2(x), layer, step), step)
            return x + self.mlp(self.ln2(x))

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(CONTEXT, DIM)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)
            # reserved special ids (257..) rare, as a trained model makes them: random weights put
            # half the logits' mass above the bytes, and a short completion of special ids only
            # decodes to no text (bench_serving counts such a stream failed)
            prior = torch.zeros(VOCAB)
            prior[EOS + 1:] = -SPECIAL_PENALTY
            self.register_buffer("prior", prior)

        def logits(self, x):
            return self.head(self.norm(x)) + self.prior

        def forward(self, ids, positions, pool, step):
            """ids, positions: LongTensor[t]; step: Step (the slots of the prefix and of these tokens)."""
            x = self.tok(ids) + self.pos(positions)
            for i, block in enumerate(self.blocks):
                x = block(x, i, pool, step)
            return self.logits(x)

        def early_exit(self, ids, positions, pool, step):
            """The draft model of STANDALONE speculation here: the first block and the head only
            (an early exit of this model, as LayerSkip-style self-speculation drafts); its KV is the
            target's first layer's, which it writes to step.slots."""
            return self.logits(self.blocks[0](self.tok(ids) + self.pos(positions), 0, pool, step))

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    return TinyLM().eval()


class Step:
    """One forward step of one request: `prefix` (LongTensor of the KV slots already holding the
    context, req_to_token[req, :P]), `slots` (LongTensor of the slots these t tokens' K/V go to,
    SGLang's out_cache_loc), `verify` (a target-verify step: its attention goes through the hook),
    `ctx` (the forward pass's PassCtx, or None)."""

    def __init__(self, prefix, slots, verify=False, ctx=None):
        self.prefix, self.slots, self.verify, self.ctx = prefix, slots, verify, ctx


class PassCtx:
    """What one forward pass's kernels read and write: `counts` (int32 [LAYERS, EXPERTS], the
    MoE layers add their routed tokens; None: not counted, a draft pass), `hot` ((layer, expert)
    or None), `slow_s` (seconds each attention region sleeps), `tp_size`."""

    def __init__(self, counts=None, hot=None, slow_s=0.0, tp_size=1):
        self.counts, self.hot, self.slow_s, self.tp_size = counts, hot, slow_s, tp_size


class KVPool:
    """The KV cache in SGLang's layout: per layer k_buffer / v_buffer [size + 1, KV_HEADS, HEAD_DIM]
    (MHATokenToKVPool, sglang/srt/mem_cache/memory_pool.py; slot 0 is the dummy slot padded
    requests write to, never handed out: TokenToKVPoolAllocator, mem_cache/allocator.py), and a free
    list of slots. One request runs at a time here (Engine.lock), so the allocator needs no lock.

    attend(layer, q, k, v, step) writes k, v to step.slots and returns the attention output
    [t, HEADS, HEAD_DIM] of q over the prefix and these tokens (causal): for a target-verify step
    through `verify` (the installed SGLang's fleetctl_verify.verify_fwd, called as its Triton
    backend calls extend_attention_fwd) when it serves the call, else (and for every other step)
    its own attention. `calls` counts {"verify_hook", "verify_own"} target-verify attention calls."""

    def __init__(self, torch, size, verify=None):
        self.torch, self.size, self.verify = torch, size, verify
        shape = (size + 1, KV_HEADS, HEAD_DIM)
        self.k = [torch.zeros(shape) for _ in range(LAYERS)]
        self.v = [torch.zeros(shape) for _ in range(LAYERS)]
        self.free_slots = list(range(size, 0, -1))  # pop() hands out the lowest slot first
        self.calls = {"verify_hook": 0, "verify_own": 0}

    def alloc(self, n):
        """n free slots (LongTensor), or BadRequest when the pool has fewer."""
        if n > len(self.free_slots):
            raise BadRequest("KV pool exhausted: %d slots asked, %d free" % (n, len(self.free_slots)))
        return self.torch.tensor([self.free_slots.pop() for _ in range(n)], dtype=self.torch.int64)

    def release(self, slots):
        """Give `slots` (LongTensor or list) back to the free list."""
        self.free_slots.extend(int(s) for s in reversed(list(slots)))

    def attend(self, layer, q, k, v, step):
        """The attention of `step` in its kernels' regions: decode (one token after a prefix)
        in KERNELS["attention_decode"]'s two, a prefill or a target verify in the extend
        kernel's; each sleeps step.ctx.slow_s more inside (slow_attention_ms). The metadata (the
        KV indices, the mask, the hook's keywords) is made before the region, as SGLang's
        backends make theirs in init_forward_metadata; the KV reads and the attention are inside."""
        torch = self.torch
        kb, vb = self.k[layer], self.v[layer]
        kb[step.slots], vb[step.slots] = k, v  # SGLang writes the new tokens' K/V before attention
        slow = step.ctx.slow_s if step.ctx is not None else 0.0
        decode = q.shape[0] == 1 and step.prefix.numel() > 0 and not step.verify
        names = KERNELS["attention_decode"] if decode else KERNELS["attention_extend"]
        t, P = q.shape[0], step.prefix.numel()
        hook = None
        if step.verify and self.verify is not None:
            o = torch.empty_like(q)
            hook = self.verify_args(q, k, v, o, kb, vb, step.prefix, t)
        idx = torch.cat([step.prefix, step.slots])
        mask = torch.arange(P + t)[None, :] <= (P + torch.arange(t))[:, None]
        with region(torch, names[0]):
            o = self._attend(q, step, kb, vb, hook, idx, mask)
            if slow > 0:
                time.sleep(slow)
        if decode:
            with region(torch, names[1]):
                o = o.contiguous()
        return o

    def _attend(self, q, step, kb, vb, hook, idx, mask):
        """The attention itself: through the verify hook when it serves `hook` (its keywords),
        else the stand-in's own over the slots `idx` with the causal `mask`."""
        if hook is not None and self.verify(**hook):
            self.calls["verify_hook"] += 1
            return hook["o_extend"]
        if step.verify:
            self.calls["verify_own"] += 1
        keys = kb[idx].repeat_interleave(HEADS // KV_HEADS, dim=1)  # query head h reads KV head h // G
        vals = vb[idx].repeat_interleave(HEADS // KV_HEADS, dim=1)
        o = self.torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1), attn_mask=mask)
        return o.transpose(0, 1)

    def verify_args(self, q, k, v, o, kb, vb, prefix, t):
        """extend_attention_fwd's keywords as SGLang's Triton backend passes them in target verify
        (0.5.23 sglang/srt/layers/attention/triton_backend.py forward_extend and
        init_forward_metadata's target-verify branch: qo_indptr int32 [0, T], kv_indptr int32
        [0, P], kv_indices int64 the prefix slots, a bool custom_mask of T x (P + T) per request (the
        chain: every prefix column, the drafts causal), mask_indptr int64, max_len_extend T)."""
        torch = self.torch
        P = prefix.numel()
        mask = torch.ones(t, P + t, dtype=torch.bool)
        mask[:, P:] = torch.ones(t, t, dtype=torch.bool).tril()
        return {"q_extend": q, "k_extend": k, "v_extend": v, "o_extend": o, "k_buffer": kb, "v_buffer": vb,
                "qo_indptr": torch.tensor([0, t], dtype=torch.int32),
                "kv_indptr": torch.tensor([0, P], dtype=torch.int32), "kv_indices": prefix,
                "custom_mask": mask.flatten(), "is_causal": True,
                "mask_indptr": torch.tensor([0, t * (P + t)], dtype=torch.int64), "max_len_extend": t,
                "k_scale": 1.0, "v_scale": 1.0, "sm_scale": HEAD_DIM ** -0.5, "logit_cap": 0.0,
                "page_size": 1}


def load_verify_hook(attention_backend):
    """fleetctl_verify.verify_fwd of the SGLang installed beside this interpreter, loaded by file
    path (sglang/srt/layers/attention/fleetctl_verify.py, found with importlib.util.find_spec,
    which does not import sglang: `import sglang` fails in the lab's no-deps venvs), when the
    server runs the Triton attention backend (the only one whose target verify SGLang routes
    there) and the file exists. Returns (verify_fwd or None, what was found, for the log)."""
    import importlib.util
    if attention_backend != "triton":
        return None, "attention backend %s: own verify attention" % (attention_backend or "unset")
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None, "no sglang installed: own verify attention"
    path = os.path.join(list(spec.submodule_search_locations)[0], "srt", "layers", "attention", "fleetctl_verify.py")
    if not os.path.isfile(path):
        return None, "no %s: own verify attention" % path
    hook_spec = importlib.util.spec_from_file_location("fleetctl_verify", path)
    mod = importlib.util.module_from_spec(hook_spec)
    hook_spec.loader.exec_module(mod)
    fwd = getattr(mod, "verify_fwd", None)
    return fwd, ("verify attention through %s" % path if fwd is not None
                 else "%s loaded, its verify_fwd is None (see its warning): own verify attention" % path)


def lookup_draft(context, width, max_ngram=3):
    """Prompt-lookup draft (SGLang's NGRAM speculative algorithm drafts from the context the same
    way): the `width` tokens that followed the latest earlier occurrence of the context's last
    n-gram (n from max_ngram down to 1), padded with the last token to exactly `width`."""
    n_ctx = len(context)
    for n in range(min(max_ngram, n_ctx - 1), 0, -1):
        tail = context[n_ctx - n:]
        for start in range(n_ctx - n - 1, -1, -1):
            if context[start:start + n] == tail:
                follow = context[start + n:start + n + width]
                return follow + [context[-1]] * (width - len(follow))
    return [context[-1]] * width


class Engine:
    """One model, one request at a time (a lock plays the scheduler); `inflight` counts the
    requests that have arrived and not finished, the one decoding and those waiting. `draft_tokens`:
    speculative decoding's T (None: plain decoding), `verify`: the hook (load_verify_hook); `moe`:
    the MoE model; `tp_size`: the ranks whose all-reduce the passes run.

    Forward passes run on one scheduler thread (on_scheduler), numbered by forward_ct as SGLang's
    scheduler numbers its batches (one pass: a prefill, a decode step, or a verify with its
    drafts); before each, `profiler.on_pass(stage, forward_ct)`, after each of the MoE model's,
    `recorder.on_pass(forward_ct, counts)` when set (instruments.py). An exception of
    `crash_types` on that thread goes to `on_crash` (the server's: it dies) before it is raised."""

    def __init__(self, seed, behavior, pool_size=CONTEXT, draft_tokens=None, verify=None, algorithm="NGRAM",
                 moe=False, tp_size=1):
        import torch
        from concurrent.futures import ThreadPoolExecutor
        self.torch = torch
        self.model = build_model(seed, moe)
        self.moe, self.tp_size = moe, tp_size
        self.pool = KVPool(torch, max(pool_size, CONTEXT + 16), verify)
        self.draft_tokens, self.algorithm = draft_tokens, algorithm
        self.behavior = behavior
        self.lock = threading.Lock()
        self.inflight = 0
        self.waiting_tokens = 0  # prompt tokens of the requests waiting for the lock
        self.count_lock = threading.Lock()
        # torch's intra-op thread count is per thread (OpenMP's): one there too, as build_model sets here
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="fleetctl-standin-scheduler",
                                         initializer=torch.set_num_threads, initargs=(1,))
        self.forward_ct = self.decode_ct = 0
        self.profiler = self.recorder = None
        self.crash_types, self.on_crash = (), None
        # speculative totals as SGLang's scheduler keeps them: accepted tokens (the drafts taken
        # plus the target's own) and verify passes, folded into the totals every
        # DECODE_LOG_INTERVAL decode passes (0.5.10 observability/scheduler_metrics_mixin.py:180-182,
        # 629-630; 0.5.23 managers/scheduler_components/metrics_reporter.py:551-553, 999-1000)
        self.spec_accept = self.spec_fwd = self.spec_total_accept = self.spec_total_fwd = 0

    def on_scheduler(self, fn):
        """fn() run on the scheduler thread (in inference mode); its result, or what it raised
        (one of crash_types after on_crash had it)."""
        def run():
            try:
                with self.torch.inference_mode():
                    return fn()
            except self.crash_types as e:
                self.on_crash(e)
                raise
        return self.worker.submit(run).result()

    def avg_spec_accept_length(self):
        """/server_info's avg_spec_accept_length (0.5.10 managers/scheduler.py:3081-3084): accepted
        tokens per verify pass over the folded totals; None before the first fold."""
        return self.spec_total_accept / self.spec_total_fwd if self.spec_total_fwd else None

    def load(self):
        """0.5.2's internal_states "load" (managers/scheduler.py:2209-2229): KV slots held plus the
        waiting requests' prompt tokens."""
        return self.pool.size - len(self.pool.free_slots) + self.waiting_tokens

    def _pass(self, stage, fn):
        """One forward pass of `stage` ("EXTEND" or "DECODE"), run on the scheduler thread: fn(PassCtx)
        with the profiler before it and the recorder after it; fn's result."""
        torch = self.torch
        self.forward_ct += 1
        if self.profiler is not None:
            self.profiler.on_pass(stage, self.forward_ct)
        b = self.behavior
        hot = b.get("hot_expert")
        ctx = PassCtx(torch.zeros((LAYERS, EXPERTS), dtype=torch.int32) if self.moe else None,
                      (int(hot["layer"]), int(hot["expert"])) if hot else None,
                      float(b.get("slow_attention_ms", 0)) / 1000.0, self.tp_size)
        out = fn(ctx)
        if self.recorder is not None and ctx.counts is not None:
            self.recorder.on_pass(self.forward_ct, ctx.counts)
        if stage == "DECODE":
            self.decode_ct += 1
            if self.decode_ct % DECODE_LOG_INTERVAL == 0:
                self.spec_total_accept += self.spec_accept
                self.spec_total_fwd += self.spec_fwd
                self.spec_accept = self.spec_fwd = 0
        return out

    def generate(self, prompt, sp, on_token=None, logprobs=None):
        """Decode for one prompt. prompt: token ids; sp: sampling params dict (SamplingParams names);
        on_token(output_ids so far), if given, is called after each token (a stream's writer);
        logprobs: None, or {"top": N, "start": logprob_start_len} to fill in (see _logprobs).

        Returns (output_ids, finish_reason dict, info: {"spec_verify_ct", "spec_num_correct_drafts",
        and with logprobs the meta_info logprob keys}). Raises BadRequest on invalid input, and what
        on_token raises (a client gone: OSError).
        """
        with self.count_lock:
            self.inflight += 1
        try:
            return self._generate(prompt, sp, on_token, logprobs)
        finally:
            with self.count_lock:
                self.inflight -= 1

    def _pick(self, row, temperature, gen, shift):
        torch = self.torch
        if temperature < 1e-5:
            nxt = int(row.argmax())
        else:
            with region(torch, KERNELS["sampling"][0]):
                nxt = int(torch.multinomial(torch.softmax(row / temperature, -1), 1, generator=gen))
        return (nxt + shift) % VOCAB

    def _generate(self, prompt, sp, on_token, logprobs):
        torch = self.torch
        if not prompt or any(not isinstance(i, int) or not 0 <= i < VOCAB for i in prompt):
            raise BadRequest("input_ids must be a non-empty list of ints in [0, %d)" % VOCAB)
        max_new = sp.get("max_new_tokens", 128)
        if max_new is None or max_new < 0:
            raise BadRequest("max_new_tokens must be a non-negative int")
        if len(prompt) + max_new > CONTEXT:
            raise BadRequest("Requested token count exceeds the model's maximum context length "
                             "of %d tokens" % CONTEXT)
        temperature = sp.get("temperature", 1.0)
        temperature = 1.0 if temperature is None else float(temperature)
        stops = set(sp.get("stop_token_ids") or ()) | {EOS}
        gen = torch.Generator().manual_seed(sp.get("sampling_seed") or 0)
        # speculative only for greedy requests (a sampled one decodes plainly here)
        T = self.draft_tokens if self.draft_tokens and temperature < 1e-5 else None
        with self.count_lock:
            self.waiting_tokens += len(prompt)
        with self.lock:
            with self.count_lock:
                self.waiting_tokens -= len(prompt)
            # the whole request on the scheduler thread (one hop; the lock already serializes them)
            return self.on_scheduler(lambda: self._decode(prompt, sp, max_new, temperature, stops, gen, T,
                                                          on_token, logprobs))

    def _decode(self, prompt, sp, max_new, temperature, stops, gen, T, on_token, logprobs):
        """_generate's decoding loop, on the scheduler thread: one forward pass (_pass) whenever
        no decided token is pending; the behaviour's slowdowns after each token. Returns
        generate's triple."""
        out, rows, info = [], [], {"spec_verify_ct": 0, "spec_num_correct_drafts": 0, "draft_tokens": T}
        finish = {"type": "length", "length": max_new}
        held = []  # slots of the context (req_to_token's row)
        b = self.behavior
        shift = int(b.get("token_shift", 0))
        slowdown = float(b.get("slowdown", 1.0))
        delay_s = float(b.get("delay_ms", 0)) / 1000.0
        contention_s = float(b.get("contention_ms", 0)) / 1000.0
        truncate = b.get("truncate_tokens")
        try:
            pending = []  # tokens decided and not yet emitted (a verify step decides several)
            while len(out) < max_new:
                t0 = time.perf_counter()
                if not pending:
                    pending, lp_rows = self._pass("DECODE" if out else "EXTEND", lambda ctx: self._advance(
                        prompt, out, held, T, temperature, gen, shift, info, ctx))
                    rows_pending = list(lp_rows)
                nxt = pending.pop(0)
                rows.append(rows_pending.pop(0))
                out.append(nxt)
                if slowdown > 1.0:
                    time.sleep((slowdown - 1.0) * (time.perf_counter() - t0))
                if delay_s > 0:
                    time.sleep(delay_s)
                if contention_s > 0 and self.inflight > 1:
                    time.sleep(contention_s * (self.inflight - 1))
                if truncate is not None and len(out) >= truncate:
                    finish = {"type": "stop", "matched": EOS}
                    break
                if (nxt in stops and not sp.get("ignore_eos", False)
                        and len(out) >= sp.get("min_new_tokens", 0)):
                    finish = {"type": "stop", "matched": nxt}
                    break
                if on_token is not None and len(out) < max_new:
                    on_token(out)
            if logprobs is not None:
                info.update(self._logprobs(prompt, out, rows, logprobs))
        finally:
            self.pool.release(held)
            held.clear()
        return out, finish, info

    def _advance(self, prompt, out, held, T, temperature, gen, shift, info, ctx=None):
        """One forward step for the request: the prefill (nothing decoded yet), a plain decode
        step, or with T a target-verify step over [last token, T-1 prompt-lookup drafts] with greedy
        acceptance. `held` (the context's slots) grows by the tokens whose K/V are now cached;
        `ctx`: the pass's PassCtx. Returns (the tokens it decided, in order; their logit rows, for
        logprobs)."""
        torch = self.torch
        pool = self.pool
        if not out:  # prefill: the prompt's K/V, the first token from its last row
            slots = pool.alloc(len(prompt))
            held.extend(slots.tolist())
            logits = self.model(torch.tensor(prompt), torch.arange(len(prompt)), pool,
                                Step(torch.empty(0, dtype=torch.int64), slots, ctx=ctx))
            self.prefill_logits = logits
            return [self._pick(logits[-1], temperature, gen, shift)], [logits[-1]]
        context = prompt + out
        n = len(context) - 1  # the last token's K/V is not cached yet
        prefix = torch.tensor(held, dtype=torch.int64)
        if T is None or n + T > CONTEXT:
            slots = pool.alloc(1)
            held.extend(slots.tolist())
            logits = self.model(torch.tensor(out[-1:]), torch.tensor([n]), pool, Step(prefix, slots, ctx=ctx))
            return [self._pick(logits[-1], temperature, gen, shift)], [logits[-1]]
        slots = pool.alloc(T)
        if self.algorithm == "NGRAM":
            drafts = lookup_draft(context, T - 1)
        else:  # STANDALONE: T-1 greedy steps of the early-exit draft, its layer-0 K/V in the verify's slots
            drafts = []
            draft_ctx = None if ctx is None else PassCtx(None, ctx.hot, ctx.slow_s, ctx.tp_size)  # not recorded
            for j in range(T - 1):
                row = self.model.early_exit(torch.tensor((out[-1:] + drafts)[-1:]), torch.tensor([n + j]), pool,
                                            Step(torch.cat([prefix, slots[:j]]), slots[j:j + 1], ctx=draft_ctx))
                drafts.append((int(row[-1].argmax()) + shift) % VOCAB)
        logits = self.model(torch.tensor(out[-1:] + drafts), torch.arange(n, n + T), pool,
                            Step(prefix, slots, verify=True, ctx=ctx))
        with region(torch, KERNELS["verify_accept"][0]):
            targets = [(int(i) + shift) % VOCAB for i in logits.argmax(-1)]
            accepted = 0
            while accepted < T - 1 and drafts[accepted] == targets[accepted]:
                accepted += 1
        self.spec_accept += accepted + 1
        self.spec_fwd += 1
        held.extend(slots[:accepted + 1].tolist())  # the last token and the accepted drafts
        pool.release(slots[accepted + 1:])
        info["spec_verify_ct"] += 1
        info["spec_num_correct_drafts"] += accepted
        return targets[:accepted + 1], [logits[i] for i in range(accepted + 1)]

    def _logprobs(self, prompt, out, rows, want):
        """SGLang's meta_info logprob keys (0.5.23 tokenizer_manager.py detokenize_logprob_tokens,
        :3098-3116: (logprob, token_id, None) tuples without return_text_in_logprobs;
        detokenize_top_logprobs_tokens :3118-3135): output_token_logprobs (the log-softmax of the
        row that picked each output token), output_top_logprobs (the top N of each row, when
        top_logprobs_num N > 0), input_token_logprobs / input_top_logprobs from logprob_start_len
        (-1: the last prompt token only), the first prompt token's logprob None."""
        torch = self.torch
        top = int(want.get("top") or 0)
        start = want.get("start", -1)
        start = len(prompt) - 1 if start is None or start < 0 else min(int(start), len(prompt) - 1)
        out_lp = [torch.log_softmax(r.double(), -1) for r in rows]
        meta = {"output_token_logprobs": [[float(lp[i]), i, None] for lp, i in zip(out_lp, out)],
                "output_token_logprobs_length": len(out)}
        pre = torch.log_softmax(self.prefill_logits.double(), -1)  # row j predicts prompt[j + 1]
        meta["input_token_logprobs"] = [[None if j == 0 else float(pre[j - 1][prompt[j]]), prompt[j], None]
                                        for j in range(start, len(prompt))]
        if top > 0:
            def topk(lp):
                v, i = lp.topk(min(top, VOCAB))
                return [[float(a), int(b), None] for a, b in zip(v, i)]
            meta["output_top_logprobs"] = [topk(lp) for lp in out_lp]
            meta["input_top_logprobs"] = [None if j == 0 else topk(pre[j - 1]) for j in range(start, len(prompt))]
        return meta
