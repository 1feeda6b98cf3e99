"""MoE balance from an expert distribution recorder's dump, with SGLang's own balancedness
(stdlib only, pure).

The dump (`/dump_expert_distribution_record` in "stat" mode: 0.5.23
srt/eplb/expert_distribution.py:999 writes dict(rank, logical_count, ...) with torch.save,
:1038-1044) holds `logical_count`, shape (steps, layers, logical experts): how many tokens each
layer routed to each expert in each recorded forward pass. The child (child.py) turns it into
nested lists; this module sums the steps and places logical expert e on GPU e // (experts /
ep_size), SGLang's layout without redundant experts (physical == logical; compute_gpu_physical_count,
:1140-1150, groups a layer's physical experts into ep_size consecutive blocks).

Balancedness of a layer, SGLang's definition (compute_utilization_rate, 0.5.23
srt/eplb/expert_distribution.py:1153-1168): (mean over GPUs of the GPU's count + 1e-5) / (max
over GPUs + 1e-5); 1.0 is perfectly balanced, 1/ep_size is one GPU taking everything.
"""

EPS = 1e-5
MAX_LAYERS = 4096
MAX_EXPERTS = 4096


def _sum_steps(count):
    """[layers][experts] totals of `count` ([steps][layers][experts] or [layers][experts] of
    non-negative numbers); ValueError for another shape or a value that is not a number."""
    if not isinstance(count, list) or not count:
        raise ValueError("logical_count is empty or not a list")
    steps = count if isinstance(count[0], list) and count[0] and isinstance(count[0][0], list) else [count]
    layers = len(steps[0])
    experts = len(steps[0][0]) if layers else 0
    if not (0 < layers <= MAX_LAYERS and 0 < experts <= MAX_EXPERTS):
        raise ValueError("logical_count has %d layers of %d experts" % (layers, experts))
    total = [[0.0] * experts for _ in range(layers)]
    for s in steps:
        if not isinstance(s, list) or len(s) != layers:
            raise ValueError("logical_count's steps differ in shape")
        for li, row in enumerate(s):
            if not isinstance(row, list) or len(row) != experts:
                raise ValueError("logical_count's layers differ in shape")
            for e, v in enumerate(row):
                if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                    raise ValueError("logical_count holds a value that is not a count")
                total[li][e] += v
    return total


def balance(count, ep_size):
    """The balance of dump `count` (logical_count as nested lists) over `ep_size` GPUs:
    {"layers": [{"layer", "gpu_counts": [per GPU], "balancedness", "hot_gpu", "hot_expert",
    "hot_gpu_share" (the hot GPU's share of the layer's tokens), "tokens", "expert_balancedness" (the
    same formula over experts instead of GPUs)}], "experts", "ep_size",
    "worst": the layer entry of least balancedness (None when no token was routed),
    "mean_balancedness" (over layers that routed any token)}.
    Raises ValueError for a shape it cannot read, or experts not divisible by ep_size."""
    total = _sum_steps(count)
    experts = len(total[0])
    if not isinstance(ep_size, int) or ep_size < 1 or experts % ep_size:
        raise ValueError("%d experts cannot be laid out on ep_size %r GPUs" % (experts, ep_size))
    per = experts // ep_size
    layers = []
    for li, row in enumerate(total):
        gpus = [sum(row[g * per:(g + 1) * per]) for g in range(ep_size)]
        hot = max(range(ep_size), key=lambda g: gpus[g])
        s = sum(gpus)
        layers.append({"layer": li, "gpu_counts": gpus,
                       "balancedness": (s / ep_size + EPS) / (gpus[hot] + EPS),
                       "hot_gpu": hot, "hot_expert": max(range(experts), key=lambda e: row[e]),
                       "hot_gpu_share": gpus[hot] / s if s else 0.0, "tokens": s,
                       "expert_balancedness": (s / experts + EPS) / (max(row) + EPS)})
    routed = [x for x in layers if x["tokens"] > 0]
    worst = min(routed, key=lambda x: (x["balancedness"], x["layer"])) if routed else None
    return {"layers": layers, "experts": experts, "ep_size": ep_size, "worst": worst,
            "mean_balancedness": sum(x["balancedness"] for x in routed) / len(routed) if routed else None}
