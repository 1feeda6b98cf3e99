"""SGLang's Triton target verify, routed to the verify_attention kernel fleetctl deployed.

triton_backend.py's guard (in TritonAttnBackend.forward_extend, right before its extend call)
calls verify_fwd with that call's arguments, each named as extend_attention_fwd names it. It
returns True when the deployed kernel wrote `o_extend`, False (o_extend untouched: SGLang's own
kernel runs) for anything it does not serve. verify_fwd is None (the guard does nothing) when the
build cannot be trusted; the reason is logged once, on logger "fleetctl.verify".

This file is the hook's body, plain Python in fleetctl's playbooks/ (tests import it). The module
the playbook writes (fleetctl_verify.py.j2 renders it) is this text, then the text of fleetctl's
probes/buildtrust.py (the trust walk, the dispatch table reader and NEEDED: the code the
verify_attention_route finding runs too), then the values the host's finding gave (_LINK, _TORCH)
and `verify_fwd = make(_LINK, _TORCH, <buildtrust's names>)`.

The build is the published one (PUBLIC = the fleetctl-kernels directory, world-readable, so a
server of any uid can load it) that `link`, PUBLIC/verify_attention/current, names when make runs
(once per process, at import; a later deploy takes effect at the server's restart). It is
trusted only when every path component from / to PUBLIC/verify_attention, everything in the
build's directory and PUBLIC/verify_attention/dispatch.json (when there) belong to root and no
one else may write them (a root-owned sticky directory such as /tmp above the package directory
is fine), no symbolic link is on the way but `current` itself, which names a directory beside it,
and PASSED's module lies in that build's build/ (buildtrust.walk: the verify_attention_route
finding, probes/facts/verifyroute.py, runs the same code, so its kernel.active never says yes
where this module refuses). Its record must match this process: build.ninja
(torch.utils.cpp_extension's, the cpu and cuda builds) compiled against this torch, or
build/kernels/manifest.json (the triton build) made with this torch; and this torch is the one
fleetctl saw (`torch_version`). The module itself is loaded at the first call it can serve (a
CUDA device is then current: nothing touches CUDA at import); a build that fails to load routes
nothing.

Shapes are routed only where the dispatch table (dispatch.json beside `current`, schema
"fleetctl-dispatch/1", written by `fleetctl deploy kernel`) allows: its "build" must be the key
`current` names (else nothing routes), and then every shape the build serves when "all" is true,
else a call of (head_dim, group, draft_tokens, dtype) routes when an entry lists it with batch <=
its max_batch (null: any batch). No table, one that does not parse, or one enabling nothing:
nothing routes, said once.

Imports nothing from sglang; never raises. Per call it reads shapes, dtypes, devices and Python
scalars only (no host sync, no allocation: CUDA-graph capture safe).

Routing evidence (what the route gate reads): each process's record, PUBLIC/route-evidence/<euid>/
<pid>.json, one JSON object:
  pid, start_time   this process; start_time is /proc/<pid>/stat's starttime (clock ticks after
                    boot): the pair names one process, a reused pid has another
  boot_id           /proc/sys/kernel/random/boot_id: a record of an earlier boot, whose pid and
                    start tick a process of this boot may repeat, names another boot
  uid               this process's effective uid (the directory's owner)
  build, module     the build directory `current` named at import, PASSED's module in it
  captured          [{batch, draft_tokens, head_dim, group, dtype}], sorted: the shapes routed while
                    the current CUDA stream was capturing a graph (each replay of that graph runs
                    the kernel; replays run no Python and are not counted)
  eager_routed      routed calls outside a capture (a capture's warm-up runs count here)
  fallbacks         {reason: calls} left to SGLang's kernel, capture or not (reasons: "keyword
                    missing NAME", "keyword NAME", "not causal", "max_len_extend not an int", "sm_scale not a number",
                    "not 3-D tensors", "dtype DTYPE", "mixed dtypes", "mixed head dims", "heads not
                    a group", "uneven draft widths", "device", "shape not enabled", "batch over
                    max_batch", "build did not load", "error EXCEPTION")
  written, trigger  Unix time (s) of this write; what made it: "capture", "eager", "fallback"
                    (the last call before a flush), "exit"
A routed or fallen-back call marks the record dirty (under a lock, nothing else); a daemon thread,
started at the first such call of each process (a forked child starts its own, its counts its
own), writes a dirty record within _EVIDENCE_S, so a reader that waits 1.0 s after its last
request sees every call made before it. A captured set that grows is written at once, by the
capturing call (a capture's end cannot be seen from inside its calls; the thread makes no CUDA
call). atexit writes the last record (not when a signal kills the process). The write is an
atomic replace (a temp file beside it, created O_EXCL|O_NOFOLLOW 0644, then os.replace: a reader
sees the old record or the new one, and a link planted at either name is replaced, never
followed) in PUBLIC/route-evidence/<euid>, created 0755 by the first write, refused when it is a
link, not this euid's, or writable by others (and PUBLIC/route-evidence when a link, not root's,
or writable by others without the sticky bit). It never raises into SGLang: the first failure
is logged.
"""

import atexit
import importlib.machinery
import importlib.util
import json
import logging
import os
import stat
import threading
import time

_ENTRY = "verify_attention_sglang"
_EVIDENCE_S = 0.25  # longest wait (s) of a dirty routing-evidence record before the thread writes it
_log = logging.getLogger("fleetctl.verify")
_said = set()

# extend_attention_fwd's other keywords -> the Python scalars at which this kernel serves the
# call (None too: the feature is off); ANY: whatever it is (host-side metadata the kernel does
# not need). Any other value (a tensor: fp8 scales, sinks, a score_mod) or keyword is SGLang's.
ANY = None
_SERVED = {"k_scale": (1.0,), "v_scale": (1.0,), "logit_cap": (0.0,),
           "sliding_window_size": (-1,), "sinks": (), "window_kv_offsets": (), "xai_temperature_len": (-1, 0),
           "lse_extend": (), "skip_prefix": (False,), "skip_extend": (False,), "page_size": (1,), "score_mod": (),
           "aux_tensors": (), "identity_kv_indices": (False,), "max_bs": ANY, "extend_seq_lens_cpu": ANY}
# keywords SGLang's kernel reads only as a truth value (a tl.constexpr `not X`) -> the truth at
# which this kernel serves the call (SGLang 0.4.10 passes its sliding_window_size, -1 when off,
# positionally into skip_prefix_custom_mask: served, as SGLang's kernel reads it, as True)
_TRUTH = {"skip_prefix_custom_mask": True}
_SCALARS = (bool, int, float)


class _Refused(Exception):
    """The routing evidence's directory is not one this process may write in; the message says why."""


def _say(reason, key=None):
    """Log `reason` once per `key` (default: the reason itself); a per-call failure passes its
    exception's type, so messages that name shapes do not log, nor grow _said, at every call."""
    key = reason if key is None else key
    if key not in _said:
        _said.add(key)
        _log.warning("fleetctl route-verify-attention: %s", reason)


def _trusted_build(link, torch_version, trust):
    """(build dir, module path, backend, archs, all, {shape: max_batch}) of the build `link`
    names: trust.walk'ed, its record matched to this process (whose torch must be
    `torch_version`), its dispatch table read (trust.table; why nothing routes said once).
    Raises trust.Untrusted, OSError."""
    import torch

    key, bdir, module, table = trust.walk(link)
    if torch.__version__ != torch_version:
        raise trust.Untrusted("torch is %s here, %s when route-verify-attention was applied: deploy the kernel and "
                              "apply the playbook again" % (torch.__version__, torch_version))
    here = os.path.dirname(torch.__file__)
    manifest = os.path.join(bdir, "build", "kernels", "manifest.json")
    if os.path.exists(manifest):  # the triton build: its manifest names the torch it was made with
        with open(manifest) as f:
            made = json.load(f)
        if made.get("torch") != torch.__version__:
            raise trust.Untrusted("build %s was made with torch %s, this process runs %s" % (
                key, made.get("torch"), torch.__version__))
        archs = {int(made["arch"])}
    else:  # torch.utils.cpp_extension's build.ninja names the torch headers it compiled against
        with open(os.path.join(bdir, "build", "build.ninja")) as f:
            ninja = f.read()
        if not any("-isystem %s/include/torch/csrc/api/include" % d in ninja for d in (here, os.path.realpath(here))):
            raise trust.Untrusted("build %s was not compiled against this process's torch (%s)" % (key, here))
        archs = {int(w.split("arch=compute_")[1].split(",")[0]) for w in ninja.split() if "arch=compute_" in w}
    backend = os.path.basename(module).split(".")[0].rpartition("_")[2]
    every, shapes, why = trust.table(table, key)
    if why:
        _say("build %s: nothing is routed: %s" % (key, why))
    return bdir, module, backend, archs, every, shapes


def _import(module):
    """The build's module, loaded from its path (a .so extension or the triton build's .py)."""
    name = os.path.basename(module).split(".")[0]
    if module.endswith(".py"):
        loader = importlib.machinery.SourceFileLoader(name, module)
    else:
        loader = importlib.machinery.ExtensionFileLoader(name, module)
    spec = importlib.util.spec_from_file_location(name, module, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return getattr(mod, _ENTRY)


def _boot_id():
    """This boot's id (/proc/sys/kernel/random/boot_id, random(4)), or None when unread."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read(64).strip() or None
    except OSError:
        return None


def _write_evidence(evidence, pid, record):
    """Replace `evidence`/<euid>/<pid>.json (`evidence`: PUBLIC/route-evidence) with `record` as
    JSON (the module docstring's rules): every name opened relative to a directory opened
    without following a link. Raises _Refused, OSError."""
    euid = os.geteuid()
    top = os.open(evidence, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(top)
        if st.st_uid != 0 or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
            raise _Refused("%s is not root's, or others may rename what is in it (uid %d, mode %o)" % (
                evidence, st.st_uid, stat.S_IMODE(st.st_mode)))
        name = str(euid)
        try:
            os.mkdir(name, 0o755, dir_fd=top)
            made = True
        except FileExistsError:
            made = False
        except PermissionError:
            raise _Refused("%s/%s does not exist: fleetctl makes it for each server uid at deploy and before "
                           "route-verify-attention's apply" % (evidence, name))
        here = os.path.join(evidence, name)
        if stat.S_ISLNK(os.stat(name, dir_fd=top, follow_symlinks=False).st_mode):
            raise _Refused("%s is a symbolic link" % here)
        d = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top)
    finally:
        os.close(top)
    try:
        if made:
            os.fchmod(d, 0o755)  # whatever the umask
        st = os.fstat(d)
        if st.st_uid != euid:
            raise _Refused("%s belongs to uid %d, not this process's %d" % (here, st.st_uid, euid))
        if st.st_mode & 0o022:
            raise _Refused("%s is writable by group or others (mode %o)" % (here, stat.S_IMODE(st.st_mode)))
        final = "%d.json" % pid
        tmp = ".%s.%s" % (final, os.urandom(8).hex())
        f = os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                              dir_fd=d), "w")
        try:
            with f:
                os.fchmod(f.fileno(), 0o644)
                json.dump(record, f)
            os.replace(tmp, final, src_dir_fd=d, dst_dir_fd=d)
        except BaseException:
            os.unlink(tmp, dir_fd=d)
            raise
    finally:
        os.close(d)


def make(link, torch_version, trust):
    """verify_fwd over the build `link` (PUBLIC/verify_attention/current) names, trusted
    (wrapped in torch.compiler.disable, as SGLang wraps its kernels), or None with the reason
    logged. `torch_version`: the torch fleetctl saw the install run; `trust`: fleetctl's
    probes/buildtrust.py (the module, or in the rendered hook its names: NEEDED, Untrusted, walk,
    table). Never raises."""
    evidence = os.path.join(os.path.dirname(os.path.dirname(link)), "route-evidence")  # PUBLIC/route-evidence
    needed = trust.NEEDED
    try:
        import torch

        bdir, module, backend, archs, every, shapes = _trusted_build(link, torch_version, trust)
    except Exception as e:  # noqa: BLE001 - whatever PUBLIC holds, SGLang must start
        _say("not routing: %s" % (e if isinstance(e, trust.Untrusted) else "%s: %s" % (type(e).__name__, e)))
        return None
    dtypes = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
    state = {"entry": None, "broken": False, "capability": {}}
    # the routing evidence: {(batch, head_dim, group, draft_tokens, dtype)}, counts, whether the
    # record holds calls not yet written and what made it so, a failed write logged; the
    # flushing thread's pid; the locks (`lock` guards `seen`; `writing` orders the writes and is
    # taken before `lock`) and the thread's wake-up, made again in a forked child
    seen = {"captured": set(), "eager_routed": 0, "fallbacks": {}, "dirty": False, "trigger": None, "failed": False}
    sync = {"pid": None, "lock": threading.Lock(), "writing": threading.Lock(), "wake": threading.Event()}

    def _forked():
        """In a forked child: its own counts, locks and (at its first call) thread."""
        seen.update(captured=set(), eager_routed=0, fallbacks={}, dirty=False, trigger=None)
        sync.update(pid=None, lock=threading.Lock(), writing=threading.Lock(), wake=threading.Event())

    def _entry():
        """The build's SGLang-layout entry, loaded once (None when that failed)."""
        if state["entry"] is None and not state["broken"]:
            try:
                state["entry"] = _import(module)
            except Exception as e:  # noqa: BLE001
                state["broken"] = True
                _say("not routing: build %s did not load: %s: %s" % (bdir, type(e).__name__, e))
        return state["entry"]

    def _device_ok(q):
        if backend == "cpu":
            return q.device.type == "cpu"
        if q.device.type != "cuda":
            return False
        index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        if index not in state["capability"]:  # once per device: a property read, no stream work
            major, minor = torch.cuda.get_device_capability(index)
            state["capability"][index] = major * 10 + minor in archs
        return state["capability"][index]

    def _unserved(kw):
        """The first keyword of `kw` whose value this kernel does not serve, or None."""
        for name, value in kw.items():
            if name in _TRUTH:
                if type(value) not in _SCALARS or (not value) is _TRUTH[name]:
                    return name
                continue
            if name not in _SERVED:
                return name
            allowed = _SERVED[name]  # the type is checked first: `in` on a tensor would sync
            if allowed is not ANY and value is not None and not (type(value) in _SCALARS and value in allowed):
                return name
        return None

    def _record(trigger=None):
        """Write this process's routing evidence (the module docstring): always with a trigger,
        else (the thread's write) only when dirty. Never raises."""
        try:
            with sync["writing"]:
                with sync["lock"]:
                    if trigger is None and not seen["dirty"]:
                        return
                    seen["dirty"] = False
                    record = {"captured": [{"batch": b, "draft_tokens": t, "head_dim": d, "group": g, "dtype": dt}
                                           for b, d, g, t, dt in sorted(seen["captured"])],
                              "eager_routed": seen["eager_routed"], "fallbacks": dict(seen["fallbacks"]),
                              "trigger": trigger or seen["trigger"]}
                with open("/proc/self/stat") as f:
                    start = int(f.read().rpartition(")")[2].split()[19])
                record.update(pid=os.getpid(), start_time=start, boot_id=_boot_id(), uid=os.geteuid(), build=bdir,
                              module=module, written=time.time())
                _write_evidence(evidence, os.getpid(), record)
        except Exception as e:  # noqa: BLE001 - evidence is never worth a failed forward
            if not seen["failed"]:
                seen["failed"] = True
                _say("routing evidence not written (tried again at each write): %s" % (
                    e if isinstance(e, _Refused) else "%s: %s" % (type(e).__name__, e)))

    def _flush():
        """The thread: a dirty record written at once, then at most one write per _EVIDENCE_S."""
        wake = sync["wake"]
        while True:
            wake.wait()
            wake.clear()
            _record()
            time.sleep(_EVIDENCE_S)

    def _dirty(trigger):
        """Mark the record dirty (`seen` updated by the caller under sync["lock"], held here);
        start this process's thread when it has none."""
        seen["trigger"] = trigger
        if not seen["dirty"]:
            seen["dirty"] = True
            sync["wake"].set()
        if sync["pid"] != os.getpid():
            sync["pid"] = os.getpid()
            threading.Thread(target=_flush, name="fleetctl-route-evidence", daemon=True).start()

    def _routed(bs, shape):
        """Count a call the kernel served, by whether a CUDA graph is being captured (asked only
        where CUDA is already initialised: never initialises it); True."""
        try:
            capturing = torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
            with sync["lock"]:
                grew = capturing and (bs,) + shape not in seen["captured"]
                if capturing:
                    seen["captured"].add((bs,) + shape)
                else:
                    seen["eager_routed"] += 1
                _dirty("capture" if capturing else "eager")
            if grew:
                _record("capture")
        except Exception as e:  # noqa: BLE001
            _say("a routed call was not counted: %s: %s" % (type(e).__name__, e), ("not counted", type(e)))
        return True

    def _fell(why):
        """Count a call left to SGLang's kernel under `why` (a fallbacks key); False."""
        try:
            with sync["lock"]:
                seen["fallbacks"][why] = seen["fallbacks"].get(why, 0) + 1
                _dirty("fallback")
        except Exception as e:  # noqa: BLE001
            _say("a fallback was not counted: %s: %s" % (type(e).__name__, e), ("not counted", type(e)))
        return False

    def verify_fwd(**kw):
        """True when the deployed kernel wrote o_extend for this target-verify call, else False.
        `kw`: the extend call's arguments, each under extend_attention_fwd's name for it; a
        name of `needed` (trust.NEEDED, in its order) missing (a release that renamed or dropped
        it) is a fallback, never a TypeError raised into SGLang."""
        try:
            missing = [name for name in needed if name not in kw]
            if missing:
                return _fell("keyword missing " + missing[0])
            (q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
             custom_mask, is_causal, mask_indptr, max_len_extend) = [kw.pop(name) for name in needed]
            sm_scale = kw.pop("sm_scale", None)
            bad = _unserved(kw)
            if bad is not None:
                return _fell("keyword " + bad)
            if is_causal is not True:
                return _fell("not causal")
            if type(max_len_extend) is not int:
                return _fell("max_len_extend not an int")
            if not (sm_scale is None or type(sm_scale) in _SCALARS):
                return _fell("sm_scale not a number")
            for t in (q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer):
                if not isinstance(t, torch.Tensor) or t.dim() != 3:
                    return _fell("not 3-D tensors")
            dtype = dtypes.get(q_extend.dtype)
            bs, T = qo_indptr.shape[0] - 1, max_len_extend
            hq, d = q_extend.shape[1], q_extend.shape[2]
            hkv = k_buffer.shape[1]
            if dtype is None:
                return _fell("dtype %s" % q_extend.dtype)
            if any(t.dtype != q_extend.dtype for t in (k_extend, v_extend, o_extend, k_buffer, v_buffer)):
                return _fell("mixed dtypes")
            if any(t.shape[2] != d for t in (k_extend, v_extend, o_extend, k_buffer, v_buffer)):
                return _fell("mixed head dims")
            if hkv == 0 or hq % hkv:
                return _fell("heads not a group")
            if bs < 1 or T < 1 or q_extend.shape[0] != bs * T:
                return _fell("uneven draft widths")
            if not _device_ok(q_extend):
                return _fell("device")
            shape = (d, hq // hkv, T, dtype)
            if not every:
                if shape not in shapes:
                    return _fell("shape not enabled")
                if shapes[shape] is not None and bs > shapes[shape]:
                    return _fell("batch over max_batch")
            entry = _entry()
            if entry is None:
                return _fell("build did not load")
            entry(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                  custom_mask, mask_indptr, T, float(sm_scale) if sm_scale is not None else d ** -0.5)
            return _routed(bs, shape)
        except Exception as e:  # noqa: BLE001 - SGLang's kernel then writes all of o_extend
            _say("a call fell back: %s: %s" % (type(e).__name__, e), ("fell back", type(e)))
            return _fell("error " + type(e).__name__)

    atexit.register(_record, "exit")
    os.register_at_fork(after_in_child=_forked)
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(verify_fwd) if disable is not None else verify_fwd
