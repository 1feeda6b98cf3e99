"""A torch profiler chrome trace (what SGLang's /start_profile writes: `export_chrome_trace`,
0.5.23 srt/managers/scheduler_components/profiler_manager.py:359) read as a breakdown of device
time per kernel class and of the time the device waits on the host. Pure, stdlib only.

The trace's events are hostile data: only complete events (ph "X") whose name is a string, ts
and dur finite non-negative numbers are read, at most MAX_EVENTS of them, names cut to
MAX_NAME characters.

Which events are device work (`source`):
- "kernel": a GPU trace's device kernels (cat "kernel", each on a GPU stream) when it has any;
- "annotation": otherwise the `user_annotation` regions (torch.profiler.record_function): the
  lab's stand-in, which has no GPU, wraps each kernel's CPU stand-in in a region named as the
  release's kernel. Regions may nest: each counts its own (exclusive) time. A CPU trace's dense
  GEMMs are torch's own ops (GEMM_OPS, cat "cpu_op", as SGLang's unquantized layers call
  F.linear): the outermost of them outside every region count too.

Figures, in microseconds: device_us (the sum of each event's exclusive time), busy_us (the union
of all device intervals, over every stream), window_us (first start to last end), host_wait_us
(the gaps between device work shorter than IDLE_GAP_US: the device waits on scheduling and
marshaling), idle_us (longer gaps: no step to run). host_wait_share = host_wait / (busy +
host_wait); class shares are of device_us.
"""

import math

from . import kernels

MAX_EVENTS = 2000000
MAX_NAME = 200
IDLE_GAP_US = 20000.0  # a gap over 20 ms between device work is no step waiting: the server was idle
TOP = 12
GEMM_OPS = ("aten::linear", "aten::mm", "aten::addmm", "aten::matmul", "aten::bmm")


def _num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 else None


def device_events(doc):
    """(source, [(name, ts_us, dur_us, stream)]) of a parsed trace (a dict with "traceEvents" or
    a list of events): the kernel events when there are any, else the user_annotation regions
    (module docstring). stream: (pid, tid) as strings."""
    evs = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(evs, list):
        return "kernel", []
    picked = {"kernel": [], "annotation": [], "gemm": []}
    for e in evs[:MAX_EVENTS]:
        if not isinstance(e, dict) or e.get("ph") != "X" or not isinstance(e.get("name"), str):
            continue
        cat = e.get("cat")
        key = "kernel" if cat == "kernel" else "annotation" if cat == "user_annotation" else \
            "gemm" if cat == "cpu_op" and e["name"] in GEMM_OPS else None
        ts, dur = _num(e.get("ts")), _num(e.get("dur"))
        if key is None or ts is None or dur is None:
            continue
        picked[key].append((e["name"][:MAX_NAME], float(ts), float(dur), (str(e.get("pid"))[:40], str(e.get("tid"))[:40])))
    if picked["kernel"]:
        return "kernel", picked["kernel"]
    return "annotation", picked["annotation"] + _outermost(picked["gemm"], picked["annotation"])


def _outermost(ops, regions):
    """The events of `ops` inside no other event of `regions` or `ops` on their stream (a sweep:
    sorted by start, longest first, each inside when an earlier one ends no sooner)."""
    by_stream = {}
    for kind, evs in ((0, regions), (1, ops)):
        for e in evs:
            by_stream.setdefault(e[3], []).append((e[1], -(e[1] + e[2]), kind, e))
    out = []
    for items in by_stream.values():
        items.sort(key=lambda x: (x[0], x[1], x[2]))
        reach = None
        for ts, neg_end, kind, e in items:
            if kind == 1 and (reach is None or reach < -neg_end):
                out.append(e)
            reach = -neg_end if reach is None else max(reach, -neg_end)
    return out


def exclusive(events):
    """Each event's own time: its duration less the union of the events nested in it on the same
    stream (an event is nested when it starts in it and ends no later). Returns a list of
    floats, in `events`' order."""
    own = [0.0] * len(events)
    by_stream = {}
    for i, (_, ts, dur, stream) in enumerate(events):
        by_stream.setdefault(stream, []).append(i)
    for idx in by_stream.values():
        idx.sort(key=lambda i: (events[i][1], -events[i][2]))
        stack = []  # (index, end)
        for i in idx:
            _, ts, dur, _ = events[i]
            end = ts + dur
            while stack and ts >= stack[-1][1]:
                stack.pop()
            own[i] += dur
            if stack and end <= stack[-1][1]:
                own[stack[-1][0]] -= dur  # a direct child: its parent's own time is less by it
            stack.append((i, end))
    return [max(0.0, x) for x in own]


def _merged(events):
    spans = sorted((ts, ts + dur) for _, ts, dur, _ in events)
    out = []
    for a, b in spans:
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def breakdown(doc, version=None, speculative=False):
    """The breakdown of a parsed trace (module docstring), kernel names classed by
    kernels.table(version) (`speculative`: kernels.classify's). Returns {"source", "events",
    "table" (the range label), "device_us", "busy_us", "window_us", "host_wait_us", "idle_us",
    "host_wait_share", "classes": {class: us}, "shares": {class: share of device_us}, "top":
    [[name, class, us]] (the TOP names by time), "unknown": [[name, us]] (the TOP unknown
    names)}; the shares are 0 when there is no device time."""
    source, events = device_events(doc)
    label, rules = kernels.table(version)
    own = exclusive(events)
    classes = dict.fromkeys(kernels.CLASSES, 0.0)
    names = {}
    for (name, _, _, _), t in zip(events, own):
        names[name] = names.get(name, 0.0) + t
    cls_of = {n: kernels.classify(n, rules, speculative) for n in names}
    for n, t in names.items():
        classes[cls_of[n]] += t
    device = sum(classes.values())
    merged = _merged(events)
    busy = sum(b - a for a, b in merged)
    gaps = [merged[i + 1][0] - merged[i][1] for i in range(len(merged) - 1)]
    wait = sum(g for g in gaps if g <= IDLE_GAP_US)
    idle = sum(g for g in gaps if g > IDLE_GAP_US)
    ranked = sorted(names.items(), key=lambda kv: (-kv[1], kv[0]))
    return {"source": source, "events": len(events), "table": label, "device_us": device, "busy_us": busy,
            "window_us": (merged[-1][1] - merged[0][0]) if merged else 0.0, "host_wait_us": wait, "idle_us": idle,
            "host_wait_share": wait / (busy + wait) if busy + wait > 0 else 0.0,
            "classes": classes, "shares": {c: (t / device if device > 0 else 0.0) for c, t in classes.items()},
            "top": [[n, cls_of[n], t] for n, t in ranked[:TOP]],
            "unknown": [[n, t] for n, t in ranked if cls_of[n] == kernels.UNKNOWN][:TOP]}
