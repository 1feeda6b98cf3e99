"""The lab stand-in's SGLang diagnostic instruments, as the releases run them: the torch profiler
behind /start_profile and /stop_profile (Profiler) and the expert distribution recorder behind
/start_expert_distribution_record, /stop_expert_distribution_record and
/dump_expert_distribution_record (ExpertRecorder). This is not SGLang.

Both run on the engine's scheduler thread (engine.py Engine.on_scheduler), as SGLang's run in its
scheduler process: the torch profiler records the thread that started it only. An error SGLang's
scheduler would raise there (a trace or a dump it cannot write, the recorder asked for without
--expert-distribution-recorder-mode) is a SchedulerCrash: the stand-in's server then dies, as
SGLang's does (its scheduler's exception handler SIGQUITs the server: 0.5.23
managers/scheduler.py run_scheduler_process).

Releases (`release`: a tuple such as (0, 5, 23), release_key) differ in:
- ProfileReqInput's fields (PROFILE_FIELDS; 0.4.6.post5 managers/io_struct.py:844-853, 0.5.2
  io_struct.py:1136-1147, 0.5.10 io_struct.py:1514-1536, 0.5.23 ProfileReq io_struct.py:2374-2400);
  fields a release lacks are ignored, as FastAPI's body parsing ignores extra keys;
- when /start_profile answers: 0.4.6.post5 with num_steps only once the profile has stopped
  (Scheduler.start_profile returns None then and the stop's output answers it: 0.4.6.post5
  managers/scheduler.py:2140-2145, 1541-1547); later releases at once;
- how many forward passes num_steps covers: the stop comes at the start of the pass whose
  forward_ct reaches target = forward_ct at start + num_steps (0.4.6.post5-0.5.10:
  0.5.10 managers/scheduler_profiler_mixin.py:122-133), + num_steps + 1 from 0.5.23
  (managers/scheduler_components/profiler_manager.py:157), checked before each pass
  (_profile_batch_predicate, 0.5.23 profiler_manager.py:446-457, called from scheduler.py:4639
  after forward_ct += 1 at :4621). An idle server writes no trace until the next pass;
- trace file names (trace_name): `{profile_id}-TP-{tp_rank}.trace.json.gz` (0.4.6.post5
  managers/scheduler.py:2157-2161); with profile_by_stage a stage suffix, `-{str(ForwardMode)}`
  in 0.5.2 (managers/scheduler_profiler_mixin.py:184-196: an IntEnum, so "-1"/"-2" on Python
  3.11+) and `-EXTEND`/`-DECODE` from 0.5.10 (scheduler_profiler_mixin.py:270-291), which also adds
  `{profile_prefix}-` before and `-EP-{moe_ep_rank}` when ep_size > 1; output_dir is made
  (mkdir -p) at stop from 0.5.2 (0.5.2 scheduler_profiler_mixin.py:180-181, 0.5.23
  profiler_manager.py:331), not in 0.4.6.post5; the default output_dir is
  $SGLANG_TORCH_PROFILER_DIR, else /tmp (0.5.23 profiler_manager.py:130-131);
- with_stack / record_shapes defaults: True / False before 0.5.23 (profiler_manager.py:240-241);
  0.5.23's tokenizer turns both on unless the request says false (or SGLANG_PROFILE_WITH_STACK /
  SGLANG_PROFILE_RECORD_SHAPES say false: managers/tokenizer_control_mixin.py:405-415), and takes
  the request's profile_id (:416);
- the recorder's modes (RECORDER_MODES) and its dump (ExpertRecorder.dump).
"""

import logging
import os
import re
import shutil
import time
from enum import IntEnum

log = logging.getLogger("fleetctl-standin")

NEWEST = (0, 5, 23)
# ProfileReqInput / ProfileReq fields by the first release that has them (see the docstring)
PROFILE_FIELDS = (
    ((0, 4, 6), ("output_dir", "num_steps", "activities", "with_stack", "record_shapes")),
    ((0, 5, 2), ("start_step", "profile_by_stage")),
    ((0, 5, 10), ("merge_profiles", "profile_prefix", "profile_stages")),
    ((0, 5, 23), ("profile_id", "detailed_annotations")),
)
# the recorder modes each release's ServerArgs takes (0.4.6.post5 server_args.py:178-180; 0.5.2
# server_args.py:293-295; 0.5.23 arg_groups/fields/exec_.py:935-938) and the stand-in implements
# ("per_token" and "stat_approx" are not): 0.4.6.post5's _Accumulator knows "stat" only
# (managers/expert_distribution.py:438-444)
RECORDER_MODES = {(0, 4, 6): ("stat",), (0, 5, 2): ("stat", "per_pass")}
RECORDER_DEFAULT_BUFFER = 1000  # eplb_rebalance_num_iterations' default (0.5.23 arg_groups/parallel_hook.py:805-817)
NOT_SET = ("Please set ServerArgs.expert_distribution_recorder_mode to use "
           "ExpertDistributionRecorder.")  # 0.5.23 eplb/expert_distribution.py:202-205


class ForwardMode(IntEnum):
    """The two stages a by-stage profile names (0.5.2 model_executor/forward_batch_info.py:69-74)."""
    EXTEND = 1
    DECODE = 2


class SchedulerCrash(RuntimeError):
    """An exception SGLang's scheduler would not survive (see the module docstring)."""


class Refused(ValueError):
    """A request the stand-in answers with an error status without crashing: (status, text)."""

    def __init__(self, status, text):
        super().__init__(text)
        self.status, self.text = status, text


def release_key(version):
    """(major, minor, patch) of an SGLang version string ("0.4.6.post5" -> (0, 4, 6)); the newest
    release modelled here (NEWEST) for None or a string that does not parse."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version or "")
    return tuple(int(g) for g in m.groups()) if m else NEWEST


def profile_fields(release):
    """The ProfileReqInput field names of `release`."""
    return {f for first, names in PROFILE_FIELDS if release >= first for f in names}


def recorder_modes(release):
    """The --expert-distribution-recorder-mode values the stand-in serves for `release`."""
    return next(modes for first, modes in sorted(RECORDER_MODES.items(), reverse=True) if release >= first)


def trace_name(release, profile_id, tp_rank, ep_size=1, tp_size=1, prefix=None, stage=None):
    """The trace file name rank `tp_rank` writes (see the module docstring); stage: a ForwardMode
    of a by-stage profile, or None."""
    if release < (0, 5, 10):
        suffix = "-%s" % str(stage) if stage is not None else ""
        return "%s-TP-%d%s.trace.json.gz" % (profile_id, tp_rank, suffix)
    parts = [profile_id, "TP-%d" % tp_rank]
    if ep_size > 1:  # moe_ep_rank: the TP ranks split evenly over the EP ranks
        parts.append("EP-%d" % (tp_rank // max(1, tp_size // ep_size)))
    return ((prefix + "-" if prefix else "") + "-".join(parts)
            + ("-%s" % stage.name if stage is not None else "") + ".trace.json.gz")


def _env_true(name):
    """SGLang's get_bool_env_var(name, "true")."""
    return os.environ.get(name, "true").lower() in ("true", "1")


class Profiler:
    """SGLang's scheduler-side torch profiler over the stand-in's forward passes (see the module
    docstring). start/stop/on_pass run on the scheduler thread. `tp_size`, `ep_size`: the
    layout whose ranks each write the (same) trace."""

    def __init__(self, release, tp_size=1, ep_size=1):
        self.release, self.tp_size, self.ep_size = release, tp_size, ep_size
        self.prof = None
        self.in_progress = False
        self.cfg = None
        self.start_ct = self.target_ct = None
        self.by_stage = False
        self.stage_ct = {}  # by-stage counters: ForwardMode -> passes seen
        self.waiter = None  # 0.4.6.post5: the /start_profile waiting for the stop (a threading.Event)

    def parse(self, body):
        """Check a ProfileReqInput body (dict or None) -> the fields this release reads, defaults
        filled. Raises Refused(400) for what the stand-in does not implement, Refused(422) for
        a field of the wrong type (FastAPI validates the body first)."""
        body = body or {}
        if not isinstance(body, dict):
            raise Refused(400, "request body must be a JSON object")
        known = profile_fields(self.release)
        req = {k: v for k, v in body.items() if k in known}
        kinds = {"output_dir": str, "num_steps": int, "start_step": int, "activities": list,
                 "with_stack": bool, "record_shapes": bool, "profile_by_stage": bool, "merge_profiles": bool,
                 "profile_prefix": str, "profile_stages": list, "profile_id": str, "detailed_annotations": bool}
        for k, v in req.items():
            if v is not None and type(v) is not kinds[k]:
                raise Refused(422, "%s: expected %s, got %r" % (k, kinds[k].__name__, v))
        acts = req.get("activities")
        if acts is not None and (not acts or set(acts) - {"CPU", "GPU"}):
            raise Refused(400, "fleetctl stand-in profiles activities CPU and GPU only (its GPU kernels run "
                               "on its CPU), got %r" % (acts,))
        if req.get("merge_profiles") or req.get("detailed_annotations") or req.get("profile_stages"):
            raise Refused(400, "fleetctl stand-in does not implement merge_profiles, profile_stages or "
                               "detailed_annotations")
        if req.get("profile_by_stage") and not req.get("num_steps"):
            raise Refused(400, "fleetctl stand-in implements profile_by_stage with num_steps only")
        return req

    def start(self, req, forward_ct):
        """/start_profile's scheduler half at pass count `forward_ct`: returns (success, message),
        or None when the answer waits for the stop (0.4.6.post5 with num_steps; self.waiter then)."""
        r = self.release
        if self.in_progress:
            return False, "Profiling is already in progress. Call /stop_profile first."
        acts = req.get("activities") or ["CPU", "GPU"]
        with_stack, shapes = req.get("with_stack"), req.get("record_shapes")
        if r >= (0, 5, 23):
            with_stack = not (with_stack is False or not _env_true("SGLANG_PROFILE_WITH_STACK"))
            shapes = shapes is not False and _env_true("SGLANG_PROFILE_RECORD_SHAPES")
        profile_id = (req.get("profile_id") if r >= (0, 5, 23) else None) or str(time.time())
        out = req.get("output_dir") or os.getenv("SGLANG_TORCH_PROFILER_DIR", "/tmp")
        self.cfg = {"dir": os.path.expanduser(out) if r >= (0, 5, 10) else out, "id": profile_id,
                    "with_stack": True if with_stack is None else with_stack,
                    "record_shapes": False if shapes is None else shapes,
                    "prefix": req.get("profile_prefix"), "activities": acts}
        self.by_stage = bool(req.get("profile_by_stage"))
        num, start_step = req.get("num_steps"), req.get("start_step")
        self.start_ct = self.target_ct = None
        if start_step:
            self.start_ct = max(start_step, forward_ct + 1)
        if num:
            if self.by_stage:
                self.stage_ct = {ForwardMode.EXTEND: 0, ForwardMode.DECODE: 0}
                self.stage_target = num
            elif start_step:
                self.target_ct = self.start_ct + num
            else:
                self.target_ct = forward_ct + num + (1 if r >= (0, 5, 23) else 0)
        log.info("fleetctl stand-in: profile %s configured (%s)", profile_id, self.cfg)
        if self.by_stage or start_step:
            return True, "Succeeded"
        self._start()
        if num and r < (0, 5, 2):
            import threading
            self.waiter = threading.Event()
            return None
        return True, "Succeeded"

    def _start(self, stage=None):
        import torch
        log.info("fleetctl stand-in: Profiling starts%s. Traces will be saved to: %s (with profile id: %s)",
                 " for %s" % stage.name if stage else "", self.cfg["dir"], self.cfg["id"])
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                           with_stack=self.cfg["with_stack"],
                                           record_shapes=self.cfg["record_shapes"])
        self.prof.start()
        self.in_progress = True

    def stop(self, stage=None):
        """/stop_profile's scheduler half (and the stop num_steps makes): stop, write one trace per
        TP rank; (success, message). Raises SchedulerCrash when a trace cannot be written."""
        if not self.in_progress:
            return False, "Profiling is not in progress. Call /stop_profile first."
        cfg, r = self.cfg, self.release
        self.prof.stop()
        self.in_progress = False
        try:
            if r >= (0, 5, 2):
                os.makedirs(cfg["dir"], exist_ok=True)
            paths = [os.path.join(cfg["dir"], trace_name(r, cfg["id"], rank, self.ep_size, self.tp_size,
                                                         cfg["prefix"], stage)) for rank in range(self.tp_size)]
            self.prof.export_chrome_trace(paths[0])  # once a profile (torch refuses a second export)
            for path in paths[1:]:  # the other ranks ran the same passes
                shutil.copyfile(paths[0], path)
        except Exception as e:
            raise SchedulerCrash("profile trace not written to %s: %r" % (cfg["dir"], e)) from e
        finally:
            self.prof = None
            self.start_ct = None
        log.info("fleetctl stand-in: Profiling done. Traces are saved to: %s", cfg["dir"])
        if self.waiter is not None:
            self.waiter.set()
            self.waiter = None
        return True, "Succeeded."

    def on_pass(self, stage, forward_ct):
        """Before forward pass number `forward_ct` of `stage` (a ForwardMode or its name): start or stop as
        SGLang's _profile_batch_predicate does (0.5.23 profiler_manager.py:413-457)."""
        if self.cfg is None:
            return
        stage = ForwardMode[stage] if isinstance(stage, str) else stage
        if self.by_stage:
            n = self.stage_ct
            if stage == ForwardMode.EXTEND:
                if n[stage] == 0:
                    self._start(stage)
                n[stage] += 1
                if n[stage] > self.stage_target and self.in_progress:
                    self.stop(ForwardMode.EXTEND)
            else:
                if n[stage] == 0:
                    if self.in_progress:
                        self.stop(ForwardMode.EXTEND)
                    self._start(stage)
                n[stage] += 1
                if n[stage] > self.stage_target and self.in_progress:
                    self.stop(ForwardMode.DECODE)
            return
        if self.target_ct and self.target_ct <= forward_ct and self.in_progress:
            self.target_ct = None
            self.stop()
        if self.start_ct and self.start_ct == forward_ct:
            self._start()


class ExpertRecorder:
    """SGLang's expert distribution recorder over the stand-in's MoE layers (0.5.23
    eplb/expert_distribution.py; _SelectExpertsSinglePassGatherer :569-582 counts each forward
    pass's top-k expert ids per layer, [layers, experts] int32). `mode`: "stat" or "per_pass"
    (None: SGLang's no-op recorder, whose start/stop/dump raise NOT_SET, a SchedulerCrash here);
    `buffer_size`: the stat ring's passes (-1: unbounded); `tp_size`: ranks, each of which sees
    every token (TP attention: every rank routes the whole batch); `ep_size`: the experts split
    over that many ranks (expert e on rank e // (experts / ep_size)). No redundant experts:
    physical expert i is logical expert i."""

    def __init__(self, release, mode, buffer_size, layers, experts, tp_size=1, ep_size=1):
        self.release, self.mode, self.layers, self.experts = release, mode, layers, experts
        self.buffer_size = RECORDER_DEFAULT_BUFFER if buffer_size is None else buffer_size
        self.tp_size, self.ep_size = tp_size, ep_size
        self.recording = False
        self._reset()

    def _reset(self):
        self.passes = []  # (forward_pass_id, counts [layers, experts] int32), oldest first
        self.ring_at = 0  # the stat ring's next slot (a ring of buffer_size)
        self.ring = None

    def _need_mode(self):
        if self.mode is None:
            raise SchedulerCrash("Exception: " + NOT_SET)

    def start(self):
        """Start recording; clears what was recorded (0.5.23 expert_distribution.py:345-352)."""
        self._need_mode()
        if self.recording:
            log.warning("fleetctl stand-in: SGLang server is already recording expert ids.")
        self._reset()
        self.recording = True

    def stop(self):
        """Stop recording (:354-360)."""
        self._need_mode()
        if not self.recording:
            log.warning("fleetctl stand-in: SGLang server has not been recording expert ids.")
        self.recording = False

    def on_pass(self, forward_pass_id, counts):
        """One forward pass's counts ([layers, experts] int32 tensor), kept while recording."""
        if not self.recording:
            return
        if self.mode == "per_pass" or self.buffer_size < 0:
            self.passes.append((forward_pass_id, counts.clone()))
            return
        import torch
        if self.ring is None:
            self.ring = torch.zeros((self.buffer_size, self.layers, self.experts), dtype=torch.int32)
        self.ring[self.ring_at] = counts
        self.ring_at = (self.ring_at + 1) % self.buffer_size

    def dump(self, directory=None):
        """Write the record into `directory` (default $SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, else
        /tmp, made if missing: 0.5.23 expert_distribution.py:1038-1044) with torch.save and
        reset it (:362-366). Returns the paths written. Raises SchedulerCrash (no mode; a file
        that cannot be written).

        "stat" (_StatAccumulator.dump, 0.5.23 :981-1011; 0.4.6.post5
        managers/expert_distribution.py:580-600): rank 0 alone writes
        `expert_distribution_recorder_{time.time()}.pt`, {"rank": 0, "logical_count": int32
        [buffer passes, layers, experts] (the ring, unfilled passes zero; all passes for -1),
        summed over the ranks (all_reduce), "average_utilization_rate_over_window": None (the
        default eplb_min_rebalancing_utilization_threshold 1.0: :1013-1017; the key is absent in
        0.4.6.post5)}.
        "per_pass" (_DetailAccumulator.dump, :940-949): every rank writes
        `expert_distribution_recorder_{time.time()}_{rank}.pt`, {"records": [{"forward_pass_id",
        "rank", "gatherer_key": "primary", "global_physical_count": int32 [layers, experts]}, ...],
        "last_physical_to_logical_map": int64 [layers, experts], each row 0..experts-1}."""
        self._need_mode()
        import torch
        d = directory or os.environ.get("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", "/tmp")
        written = []
        try:
            if not os.path.exists(d):
                os.makedirs(d, exist_ok=True)
            if self.mode == "stat":
                if self.buffer_size < 0:
                    rows = [c for _, c in self.passes]
                    logical = (torch.stack(rows) if rows
                               else torch.zeros((0, self.layers, self.experts), dtype=torch.int32))
                else:
                    logical = (self.ring.clone() if self.ring is not None else
                               torch.zeros((self.buffer_size, self.layers, self.experts), dtype=torch.int32))
                out = {"rank": 0, "logical_count": logical * self.tp_size}
                if self.release >= (0, 5, 2):
                    out["average_utilization_rate_over_window"] = None
                written.append(self._save(d, "expert_distribution_recorder_%s.pt" % time.time(), out))
            else:
                mapping = torch.arange(self.experts).repeat(self.layers, 1)
                for rank in range(self.tp_size):
                    records = [{"forward_pass_id": fid, "rank": rank, "gatherer_key": "primary",
                                "global_physical_count": c.clone()} for fid, c in self.passes]
                    written.append(self._save(d, "expert_distribution_recorder_%s_%d.pt" % (time.time(), rank),
                                              {"records": records, "last_physical_to_logical_map": mapping}))
        except OSError as e:
            raise SchedulerCrash("expert distribution not written to %s: %r" % (d, e)) from e
        self._reset()
        return written

    @staticmethod
    def _save(d, name, data):
        import torch
        path = os.path.join(d, name)
        log.info("fleetctl stand-in: Write expert distribution to %s", path)
        torch.save(data, path)
        return path
