"""The allocator replay's child (stdlib only, Python 3.8+; the torch it imports is the install's):
what runs in the bounded child of the install's interpreter that allocreplay.run_child starts
with the probe's own bundle (action "replay"): the release's allocator classes, loaded and
driven through the trace.

The child (replay) loads the release's files from the text the probe read (not from the install
again), each under its own module name; every other `sglang.*` module and `triton` are stubs
(Stub: any attribute, call or subscript is another stub, false in a test, a plain `object` as a
base class), so only the allocator code runs. A file that needs more (a module neither stubbed
nor installed, a stubbed name it really uses) is reported with its file and line, never a crash.

The trace (drive): requests admitted first come first served up to `concurrency` running, each
prefill one `alloc(prompt)` (paged: whole pages), one decode allocation per step for the running
requests (token: `alloc(batch)`, one slot each; paged: `alloc` of one page for each request
whose last page is full, as alloc_decode takes them from the free list; the Triton
alloc_extend/alloc_decode kernels need a GPU), the newest request retracted when a decode
allocation fails (freed, re-queued first, re-prefilled with what it decoded), each finished or
aborted request freed at once with `free(torch.cat(its slots))`. No radix cache, no chunked
prefill. The figure: contiguous runs in each prefill allocation (1: one contiguous range).
"""

import collections
import importlib
import importlib.abc
import importlib.util
import inspect
import math
import sys
import time
import traceback

STUBBED = ("sglang", "triton")  # top-level names whose modules are stubs (but the release's own files)


def pages(n, page):
    """The pages of `page` tokens that `n` tokens take (n / page rounded up)."""
    return -(-n // page)


def summary(runs):
    """{"prefills", "runs_per_alloc_mean", "runs_per_alloc_p99" (nearest rank), "contiguous_share"
    (the share of allocations in one run)} of `runs`, each prefill allocation's contiguous runs."""
    if not runs:
        return {"prefills": 0, "runs_per_alloc_mean": None, "runs_per_alloc_p99": None, "contiguous_share": None}
    ordered = sorted(runs)
    return {"prefills": len(runs), "runs_per_alloc_mean": round(sum(runs) / len(runs), 3),
            "runs_per_alloc_p99": ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)],
            "contiguous_share": round(sum(1 for r in runs if r == 1) / len(runs), 4)}


class Stub(object):
    """A stubbed module's attribute: any attribute, call or subscript of it is another Stub; it is
    false, iterates as empty, and as a base class is `object`."""

    def __init__(self, name):
        object.__setattr__(self, "_name", name)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Stub("%s.%s" % (self._name, name))

    def __call__(self, *args, **kwargs):
        return Stub(self._name + "()")

    def __getitem__(self, key):
        return Stub(self._name + "[]")

    def __bool__(self):
        return False

    def __iter__(self):
        return iter(())

    def __mro_entries__(self, bases):
        return (object,)

    def __repr__(self):
        return "<fleetctl stub %s>" % self._name


class ReleaseFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports the release's files from `sources` ({module: [file, text]}) and stubs every other
    module under STUBBED's names (packages, so deeper imports stub too); records the stubs made
    in `stubbed`. First on sys.meta_path: no installed sglang or triton is ever imported."""

    def __init__(self, sources, stubbed):
        self.sources, self.stubbed = sources, stubbed

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.sources:
            spec = importlib.util.spec_from_loader(fullname, self, origin=self.sources[fullname][0])
            spec.has_location = True
            return spec
        if fullname.split(".")[0] in STUBBED:
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        name = module.__name__
        if name in self.sources:
            path, text = self.sources[name]
            module.__file__ = path
            exec(compile(text, path, "exec", dont_inherit=True), module.__dict__)
            return
        self.stubbed.append(name)

        def stub_attr(attr, _name=name):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return Stub("%s.%s" % (_name, attr))

        module.__getattr__ = stub_attr


def replay(params):
    """The child: params {"sources", "classes": [{kind, class, module}], "trace": make_trace's,
    "pool", "concurrency", "page_size", "deadline_s"}. Imports torch (one thread), loads each
    class (ReleaseFinder) and drives it with need_sort False, then True (drive). Returns {"runs",
    "stubbed", "torch", "error": None or why a class could not be loaded or driven (its file and
    line)}."""
    deadline = time.monotonic() + float(params["deadline_s"])
    out = {"runs": [], "stubbed": [], "torch": None, "error": None}
    try:
        torch = importlib.import_module("torch")
    except Exception as e:
        out["error"] = "torch is not importable by %s: %s: %s" % (sys.executable, type(e).__name__, e)
        return out
    torch.set_num_threads(1)
    out["torch"] = torch.__version__
    sources = params["sources"]
    finder = ReleaseFinder(sources, out["stubbed"])
    sys.meta_path.insert(0, finder)
    files = dict((path, name) for name, (path, _) in sources.items())
    for c in params["classes"]:
        try:
            cls = getattr(importlib.import_module(c["module"]), c["class"])
        except Exception as e:
            out["error"] = "%s needs more than the replay gives it: %s" % (_where(e, files), _said(e))
            return out
        for need_sort in (False, True):
            try:
                out["runs"].append(drive(torch, cls, c["kind"], need_sort, params, deadline))
            except Exception as e:
                out["error"] = "%s (need_sort=%s) failed in the replay at %s: %s" % (
                    c["class"], need_sort, _where(e, files), _said(e))
                return out
    out["stubbed"] = sorted(set(out["stubbed"]))
    return out


def _said(e):
    text = "%s: %s" % (type(e).__name__, e)
    if isinstance(e, ImportError):
        text += " (neither installed nor stubbed: the replay stubs only %s modules)" % " and ".join(STUBBED)
    return text


def _where(e, files):
    """"FILE line N" of the deepest frame of `e`'s traceback in one of the release's `files`."""
    where = "the replay"
    for frame in traceback.extract_tb(e.__traceback__):
        if frame.filename in files:
            where = "%s line %d" % (frame.filename, frame.lineno)
    return where


class Deadline(Exception):
    """The replay passed its deadline."""


def drive(torch, cls, kind, need_sort, params, deadline):
    """Drive allocator class `cls` ("token": TokenToKVPoolAllocator(size, dtype, device, kvcache,
    need_sort); "paged": PagedTokenToKVPoolAllocator(size, page_size, ...), by keyword) of
    params["pool"] tokens through params["trace"] (see the module docstring). Returns {"allocator",
    "kind", "page_size", "need_sort", summary()'s keys, "sorts" (merge_and_sort_free calls that
    changed the free list; None when the class has none), "sort_s" (their seconds in all),
    "sort_max_s", "retractions", "decode_steps", "elapsed_s"}. Raises Deadline, and whatever the
    allocator raises."""
    t0 = time.monotonic()
    page = params["page_size"] if kind == "paged" else 1
    given = {"size": params["pool"], "page_size": page, "dtype": torch.float16, "device": "cpu", "kvcache": None,
             "need_sort": need_sort}
    wanted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    if "need_sort" not in wanted:
        raise TypeError("%s.__init__%s takes no need_sort" % (cls.__name__, inspect.signature(cls.__init__)))
    a = cls(**{p: given[p] for p in wanted if p in given})
    sorts = {"sorts": None, "sort_s": 0.0, "sort_max_s": 0.0}
    if hasattr(a, "merge_and_sort_free"):
        sorts["sorts"] = 0
        a.merge_and_sort_free = _timed(a, a.merge_and_sort_free, sorts)
    queue = collections.deque([p, o, 0] for p, o in params["trace"])  # [prompt, output, decoded]
    running = []  # [request, [slot tensors], [decode slots], tokens held]
    runs, retractions, steps = [], 0, 0
    while queue or running:
        if time.monotonic() > deadline:
            raise Deadline("the replay passed its deadline after %d decode steps" % steps)
        while queue and len(running) < params["concurrency"]:
            req = queue[0]
            held = req[0] + req[2]
            idx = a.alloc(pages(held, page) * page)
            if idx is None:
                break
            queue.popleft()
            runs.append(int((idx[1:] != idx[:-1] + 1).sum()) + 1 if len(idx) > 1 else 1)
            running.append([req, [idx], [], held])
        while running:
            need = [r for r in running if r[3] % page == 0]
            got = a.alloc(len(need) * page) if need else None
            if got is not None or not need:
                break
            victim = running.pop()
            a.free(_slots(torch, victim))
            queue.appendleft(victim[0])
            retractions += 1
        if not running:
            continue
        steps += 1
        if kind == "token":
            for r, slot in zip(running, got.tolist()):
                r[2].append(slot)
        else:
            for i, r in enumerate(need):
                r[1].append(got[i * page:(i + 1) * page])
        for r in running:
            r[3] += 1
            r[0][2] += 1
        for r in [r for r in running if r[0][2] >= r[0][1]]:
            running.remove(r)
            a.free(_slots(torch, r))
    out = {"allocator": cls.__name__, "kind": kind, "page_size": page, "need_sort": need_sort}
    out.update(summary(runs))
    out.update(sorts, sort_s=round(sorts["sort_s"], 6), sort_max_s=round(sorts["sort_max_s"], 6),
               retractions=retractions, decode_steps=steps, elapsed_s=round(time.monotonic() - t0, 3))
    return out


def _slots(torch, r):
    """All KV slots request `r` holds, in the order it got them (its prefill, then its decodes)."""
    parts = list(r[1])
    if r[2]:
        parts.append(torch.tensor(r[2], dtype=torch.int64))
    return torch.cat(parts)


def _timed(a, sort, into):
    """`sort` (a's merge_and_sort_free) counted and timed in `into` when it changes the free list."""
    def timed(*args, **kwargs):
        before = a.free_pages
        t0 = time.perf_counter()
        sort(*args, **kwargs)
        took = time.perf_counter() - t0
        if a.free_pages is not before:
            into["sorts"] += 1
            into["sort_s"] += took
            into["sort_max_s"] = max(into["sort_max_s"], took)
    return timed
