"""SGLang's parallel layout of one server: read from its command line, and the GPUs it takes.

Pure functions (stdlib only, Python 3.8+): the facts probe (procs.find_servers) and the smoke
probe's targets (targets.live) read a server's argv with read(); the control side matches a
non-zero-rank node to its rank 0 with deployment(); gpu_ids() gives the devices SGLang's launch
code puts the server's scheduler processes on.

The options and their defaults are ServerArgs' (sglang/srt/server_args.py of 0.4.6.post5, 0.5.2
and 0.5.10; sglang/srt/arg_groups/fields/parallel.py and device.py of 0.5.23), the last one given
winning as with argparse: `--tp-size`/`--tensor-parallel-size`, `--dp-size`/`--data-parallel-size`,
`--pp-size`/`--pipeline-parallel-size` (1), `--enable-dp-attention` (off; 0.5.23 reads
`--dp-size N --enable-dp-attention` as `--attn-dp-size N`, which it also takes, with
`--attention-data-parallel-size`), `--nnodes` (1), `--node-rank` (0), `--dist-init-addr`/
`--nccl-init-addr` (none), `--base-gpu-id` (0), `--gpu-id-step` (1). `--tp`, `--dp` and `--pp` are
argparse's abbreviations (allow_abbrev) of the `-size` options, which a release accepts only
where the prefix is unique (`--pp` is ambiguous from 0.5.10 on, so a server running with it is an
older one); no other abbreviation is read. A value that is no integer is the default (SGLang
would not have started). Options from a `--config` YAML file (0.5.10 on) are not on the command
line: what a server's /server_info answers (server_info()) is the server's own word where it
answers, which a non-zero-rank node's dummy health server never does.
"""

INT_OPTIONS = (
    ("tp_size", 1, ("--tp-size", "--tensor-parallel-size", "--tp")),
    ("dp_size", 1, ("--dp-size", "--data-parallel-size", "--dp")),
    ("pp_size", 1, ("--pp-size", "--pipeline-parallel-size", "--pp")),
    ("attn_dp_size", 1, ("--attn-dp-size", "--attention-data-parallel-size")),
    ("nnodes", 1, ("--nnodes",)),
    ("node_rank", 0, ("--node-rank",)),
    ("base_gpu_id", 0, ("--base-gpu-id",)),
    ("gpu_id_step", 1, ("--gpu-id-step",)),
)
DIST_INIT_ADDR = ("--dist-init-addr", "--nccl-init-addr")
DP_ATTENTION = "--enable-dp-attention"
# what read() gives, and the /server_info keys server_info() keeps (ServerArgs field names)
KEYS = ("tp_size", "dp_size", "pp_size", "enable_dp_attention", "nnodes", "node_rank", "dist_init_addr",
        "base_gpu_id", "gpu_id_step")
MAX_ADDR = 256  # characters of a dist-init-addr kept (a string from the host is bounded)


def option(argv, *names):
    """The value of the last of `names` in argv (`--name V` or `--name=V`; the last one given
    wins, as with argparse), else None."""
    found = None
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                found = argv[i + 1]
            elif a.startswith(n + "="):
                found = a[len(n) + 1:]
    return found


def _int(value, default):
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def read(argv):
    """The layout a server's argv gives: {tp_size, dp_size, pp_size, enable_dp_attention,
    nnodes, node_rank, dist_init_addr (str or None), base_gpu_id, gpu_id_step} (ints but
    enable_dp_attention, a bool). `--attn-dp-size N` is dp_size N with DP attention, as
    0.5.23's /server_info counts it (dp_size = replicas x attention-DP groups)."""
    out = {name: _int(option(argv, *names), default) for name, default, names in INT_OPTIONS}
    attn = out.pop("attn_dp_size")
    out["enable_dp_attention"] = DP_ATTENTION in argv or attn > 1
    if attn > 1:
        out["dp_size"] = max(out["dp_size"], 1) * attn
    addr = option(argv, *DIST_INIT_ADDR)
    out["dist_init_addr"] = addr.strip()[:MAX_ADDR] if addr else None
    return out


def server_info(info):
    """The layout keys (KEYS) of a server's /server_info answer (ServerArgs as the server resolved
    it) that carry a value of the right type; {} for an answer that is no object."""
    if not isinstance(info, dict):
        return {}
    out = {}
    for k in KEYS:
        v = info.get(k)
        if k == "enable_dp_attention" and isinstance(v, bool):
            out[k] = v
        elif k == "dist_init_addr" and isinstance(v, str):
            out[k] = v.strip()[:MAX_ADDR]
        elif k not in ("enable_dp_attention", "dist_init_addr") and isinstance(v, int) and not isinstance(v, bool):
            out[k] = v
    return out


def deployment(layout):
    """The key that names a multi-node deployment: "ADDRESS:PORT/NNODES" from the dist-init-addr
    (host lower-cased, IPv6 brackets and a port's leading zeros dropped) and nnodes, the same on
    every node of one deployment; None for a single-node server or one without a dist-init-addr
    (its nodes cannot be told apart from another deployment's)."""
    addr, nnodes = layout.get("dist_init_addr"), layout.get("nnodes") or 1
    if not addr or nnodes < 2:
        return None
    host, sep, port = addr.rpartition(":")
    if sep and port.isdigit():
        addr = "%s:%d" % (host.strip("[]").lower(), int(port))
    return "%s/%d" % (addr, nnodes)


def gpu_ordinals(layout):
    """The CUDA device ordinals (as the server's process numbers them, under its
    CUDA_VISIBLE_DEVICES) of this node's scheduler processes, each once, in launch order; [] for
    a layout SGLang refuses (a size or gpu_id_step under 1, a negative base_gpu_id, node_rank
    outside nnodes, tp_size x pp_size not a multiple of nnodes: ServerArgs.check_server_args).

    As SGLang's launch code computes them: the node's pipeline and tensor ranks are
    `_calculate_rank_ranges` (0.5.10, 0.5.23 entrypoints/engine.py; inline in `_launch_subprocesses`
    of 0.4.6.post5 and 0.5.2): pp_size_per_node = max(pp_size // nnodes, 1), nnodes_per_pp_rank =
    max(nnodes // pp_size, 1), tp_size_per_node = tp_size // nnodes_per_pp_rank, and each
    scheduler's device is gpu_id = base_gpu_id + dp_offset + (pp_rank % pp_size_per_node) *
    tp_size_per_node + (tp_rank % tp_size_per_node) * gpu_id_step (engine.py, and
    data_parallel_controller.py `launch_tensor_parallel_group`). Data parallel replicas (dp_size
    > 1 without DP attention: `launch_dp_schedulers`) each start at dp_offset = dp_rank x tp_size
    x pp_size x gpu_id_step (0.5.3 on, sgl-project/sglang#10741; 0.4.6.post5 and 0.5.2 leave
    pp_size out, which puts two replicas' stages on one GPU, sglang#8963); with DP attention the
    DP ranks share the one TP group's devices (`launch_dp_attention_schedulers`: dp_offset 0)."""
    tp, pp, dp = layout["tp_size"], layout["pp_size"], layout["dp_size"]
    nnodes, rank, base, step = layout["nnodes"], layout["node_rank"], layout["base_gpu_id"], layout["gpu_id_step"]
    if min(tp, pp, dp, nnodes, step) < 1 or not 0 <= rank < nnodes or base < 0 or (tp * pp) % nnodes:
        return []
    pp_per_node = max(pp // nnodes, 1)
    nnodes_per_pp_rank = max(nnodes // pp, 1)
    tp_per_node = tp // nnodes_per_pp_rank
    if tp_per_node < 1:
        return []
    pp_ranks = range(pp_per_node * (rank // nnodes_per_pp_rank), pp_per_node * (rank // nnodes_per_pp_rank + 1))
    tp_ranks = range(tp_per_node * (rank % nnodes_per_pp_rank), tp_per_node * (rank % nnodes_per_pp_rank + 1))
    replicas = 1 if layout["enable_dp_attention"] else dp
    out = []
    for dp_rank in range(replicas):
        for pp_rank in pp_ranks:
            for tp_rank in tp_ranks:
                gpu = (base + dp_rank * tp * pp * step + (pp_rank % pp_per_node) * tp_per_node
                       + (tp_rank % tp_per_node) * step)
                if gpu not in out:
                    out.append(gpu)
    return out


def gpu_ids(layout, visible):
    """The GPUs a server's schedulers run on, as the host names them: each of gpu_ordinals() as
    the CUDA_VISIBLE_DEVICES it started with maps it (`visible`, the variable's text: entry N is
    ordinal N, as CUDA reads it and as SGLang's maybe_reindex_device_id picks one; an index,
    a GPU-UUID or a MIG name), or the ordinal itself (as a string) when `visible` is None (the
    variable unset: every GPU visible). An ordinal past the end of CUDA_VISIBLE_DEVICES is None
    (the server cannot have that device)."""
    ordinals = gpu_ordinals(layout)
    if visible is None:
        return [str(n) for n in ordinals]
    entries = [v.strip() for v in visible.split(",") if v.strip()]
    return [entries[n] if n < len(entries) else None for n in ordinals]
