"""The commands that work on hosts: inspect, hosts, validate, diagnose, apply, rollback, recover,
status, `cache clear` and `deploy kernel`. Each parses its options, calls one engine function per host
through a Fleet (hosts: connection.describe, without connecting), renders, and exits with
Ansible's code for the results.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import config
from ..errors import UsageError
from . import signals
from .console import err, out
from .options import (
    AllowDrift, AskVaultPass, ConnectionOpt, ConnectTimeout, FleetOptions, HealthTimeout, InstallOpt, InventoryOpt,
    JsonOut, KernelsDir, LatencySlack, LatencyTolerance, NoValidate, Pattern, PlaybooksDir, Port, Repeat, SshConfig,
    VaultPasswordFile, Yes, fleet_command, load_inventory, settings,
)
from .options import BecomeOpt, ExtraVarsOpt, LimitOpt, UserOpt, command_line_vars, limited
from .options import (
    GateOpt, ItlSlackMs, LoadClient, LoadConcurrency, LoadInputLen, LoadOpt, LoadOutputLen, LoadPrompts, LoadRepeat,
    LoadTimeout, MaxItlRise, MaxThroughputDrop, MaxTtftRise, TtftSlackMs, load_settings,
)
from .options import (
    AllocatorReplay, ReplayAborts, ReplayConcurrency, ReplayInput, ReplayOutput, ReplayPool, ReplayRequests,
    ReplaySeed, replay_trace,
)

app = typer.Typer()
deploy_app = typer.Typer(no_args_is_help=True, help="Deploy things to hosts.")
cache_app = typer.Typer(no_args_is_help=True, help="The hosts' scan caches (kept by inspect, one per install).")


@app.command()
@fleet_command(timeout=config.INSPECT_TIMEOUT_S, before="no_cache")
def inspect(opts: FleetOptions, pattern: Pattern,
            no_cache: Annotated[bool, typer.Option("--no-cache", help=(
                "Rescan every source file; the hosts' scan caches are neither read nor written."))] = False,
            allocator_replay: AllocatorReplay = False, pool: ReplayPool = None, concurrency: ReplayConcurrency = None,
            input_range: ReplayInput = None, output_range: ReplayOutput = None, aborts: ReplayAborts = None,
            seed: ReplaySeed = None, requests: ReplayRequests = None,
            details: Annotated[bool, typer.Option("--details", help=(
                "The full report: interpreter, every install's path, each call site and need_sort origin "
                "(without it, one summary row per host)."))] = False) -> None:
    """Inspect hosts: interpreter, SGLang, torch/CUDA, GPUs, servers, allocator call sites; with
    --allocator-replay, each install's own KV allocator replayed with need_sort False and True
    (its --timeout grows by the replay's deadline, 300 s)."""
    from functools import partial

    from ..engine.gather import inspect_job
    from ..probes.traffic.allocreplay import DEADLINE_S
    from ..report.document import inspect_document

    trace = replay_trace(allocator_replay, pool, concurrency, input_range, output_range, aborts, seed, requests)
    hosts = opts.select(pattern)
    with opts.fleet(timeout=opts.timeout + DEADLINE_S if trace is not None else None) as fleet:
        results = fleet.run(hosts, partial(inspect_job, cache=not no_cache, replay=trace), "inspect", last=True)
    _finish(results, opts.json_out, renderer("inspect", {}, details=details), hosts=inspect_document(results)["hosts"])


@app.command()
def hosts(pattern: Pattern, inventory: InventoryOpt = None, limit: LimitOpt = None, user: UserOpt = None,
          become: BecomeOpt = False, extra_vars: ExtraVarsOpt = None, vault_password_file: VaultPasswordFile = None,
          ask_vault_pass: AskVaultPass = False, json_out: JsonOut = False,
          connect_timeout: ConnectTimeout = config.CONNECT_TIMEOUT_S, ssh_config: SshConfig = None,
          connection: ConnectionOpt = None) -> None:
    """Show how each host would be reached, without connecting: connection kind, address, port,
    user, identity files, jump chain, known_hosts files and the lines that apply (from ssh -G)."""
    from ..errors import EXIT_PARSE
    from ..connection import Session
    from ..connection.describe import describe
    from ..report.terminal import render_hosts

    selected = limited(load_inventory(inventory, vault_password_file, ask_vault_pass,
                                      cli=command_line_vars(user, become, extra_vars)), pattern, limit)
    with Session(settings(connect_timeout, False, ssh_config, connection)) as session:
        docs = [describe(h, session) for h in selected]
    code = EXIT_PARSE if any(d["error"] for d in docs) else 0
    if json_out:
        from ..report.document import envelope

        _print_json(envelope({"hosts": docs}, code, None))
    else:
        render_hosts(docs, out)
    raise typer.Exit(code)


def _smoke_opts(port, health_timeout, repeat, latency_tolerance=1.25, allow_token_drift=False, latency_slack=None):
    """The SmokeOptions the smoke options give. Raises UsageError (exit 5) for one out of range."""
    from ..engine.validate import SmokeOptions

    for bad, msg in ((repeat < 1, f"--repeat must be at least 1, not {repeat}"),
                     (health_timeout <= 0, f"--health-timeout must be positive, not {health_timeout:g}"),
                     (latency_tolerance < 1.0, f"--latency-tolerance must be at least 1, not {latency_tolerance:g}"),
                     (latency_slack is not None and latency_slack < 0,
                      f"--latency-slack must not be negative, not {latency_slack}")):
        if bad:
            raise UsageError(msg)
    return SmokeOptions(port=port, health_timeout=health_timeout, repeat=repeat,
                        latency_tolerance=latency_tolerance, allow_token_drift=allow_token_drift,
                        latency_slack_s=latency_slack)


def _fits_health_wait(timeout: float | None, smoke, reserve: float) -> None:
    """Refuse a --timeout (seconds per host's job; None: the command's default, which fits) too short
    for `smoke`'s whole --health-timeout, the decodes and `reserve` seconds kept for a rollback:
    the smoke decode would otherwise cut the health wait (engine/validate.py smoke_deadline_s).
    Raises UsageError (exit 5), before any host is touched."""
    from ..engine.validate import smoke_deadline_s

    need = smoke_deadline_s(smoke, reserve)
    if timeout is not None and 0 < timeout < need:
        kept = f" and {reserve:g} s kept for a rollback" if reserve else ""
        raise UsageError(f"--timeout {timeout:g} is too short for --health-timeout {smoke.health_timeout:g}: "
                         f"each host's job needs at least {need:g} s (the health wait, the decodes of "
                         f"--repeat {smoke.repeat}{kept}); raise --timeout or lower --health-timeout")


def _positive(**values) -> None:
    """Refuse options that must be positive when given (`--timeout 0` means nothing)."""
    for name, v in values.items():
        if v is not None and v <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, not {v:g}")


def _confirm(what: str, yes: bool) -> None:
    """Ask before changing hosts: --yes skips; without a terminal nothing changes (exit 5)."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise UsageError(f"nothing changed: there is no terminal to ask 'OK to {what}?'; pass --yes to go ahead")
    if not typer.confirm(f"{what}?", default=False, err=True):
        err.print("nothing changed")
        raise typer.Exit(0)


@app.command()
@fleet_command(timeout=None, before="install")
def validate(opts: FleetOptions, pattern: Pattern,
             port: Port = config.DEFAULT_SGLANG_PORT, health_timeout: HealthTimeout = config.HEALTH_TIMEOUT_S,
             repeat: Repeat = 3, install: InstallOpt = None, load: LoadOpt = None,
             load_concurrency: LoadConcurrency = None, load_prompts: LoadPrompts = None,
             load_input_len: LoadInputLen = None, load_output_len: LoadOutputLen = None,
             load_timeout: LoadTimeout = None, load_client: LoadClient = None) -> None:
    """Smoke decode on each host itself: wait for /health, 16 greedy tokens, median latency; with
    --load PROFILE, then SGLang's own benchmark client against each server (its own install)."""
    from ..engine.load import load_options
    from ..engine.validate import validate_job

    smoke = _smoke_opts(port, health_timeout, repeat)
    _positive(timeout=opts.timeout)
    _fits_health_wait(opts.timeout, smoke, 0.0)
    settings = load_settings(load=load, concurrency=load_concurrency, num_prompts=load_prompts,
                             input_len=load_input_len, output_len=load_output_len, timeout_s=load_timeout,
                             client=load_client)
    if load is None and settings:
        raise UsageError("the --load-* options go with --load PROFILE")
    lo = load_options(settings) if load is not None else None
    hosts = opts.select(pattern)
    with opts.fleet(opts.timeout or config.smoke_job_timeout(health_timeout) + (lo.budget_s(1) if lo else 0)) as fleet:
        results = fleet.run(hosts, validate_job(smoke, install, lo), "validate")
    _finish(results, opts.json_out, renderer("validate", {}))


@app.command()
@fleet_command(timeout=None)
def diagnose(opts: FleetOptions, pattern: Pattern, port: Port = config.DEFAULT_SGLANG_PORT,
             health_timeout: HealthTimeout = config.HEALTH_TIMEOUT_S, seconds: Annotated[float, typer.Option("--seconds", help=(
                 "Profile each server for at most this many seconds (then /stop_profile)."))] = 20.0,
             steps: Annotated[int, typer.Option("--steps", help=(
                 "Profile each server for at most this many scheduler steps (ProfileReq num_steps)."))] = 20,
             load: LoadOpt = None, load_concurrency: LoadConcurrency = None, load_prompts: LoadPrompts = None,
             load_input_len: LoadInputLen = None, load_output_len: LoadOutputLen = None,
             load_timeout: LoadTimeout = None, load_client: LoadClient = None,
             allocator_replay: AllocatorReplay = False, pool: ReplayPool = None, concurrency: ReplayConcurrency = None,
             input_range: ReplayInput = None, output_range: ReplayOutput = None, aborts: ReplayAborts = None,
             seed: ReplaySeed = None, requests: ReplayRequests = None) -> None:
    """Where each server's decode time goes: a bounded profile (device time per kernel class, the
    device's wait on the host) and expert record (MoE balance per layer and GPU) under its own
    traffic or --load PROFILE, KV usage, accept length, with --allocator-replay fragmentation;
    then a verdict per server and the action that addresses it. The server is left profiling and
    recording nothing."""
    from ..engine.diagnose import DiagnoseOptions, diagnose_fleet
    from ..engine.load import load_options

    _positive(timeout=opts.timeout, seconds=seconds, steps=steps, health_timeout=health_timeout)
    trace = replay_trace(allocator_replay, pool, concurrency, input_range, output_range, aborts, seed, requests)
    settings = load_settings(load=load, concurrency=load_concurrency, num_prompts=load_prompts,
                             input_len=load_input_len, output_len=load_output_len, timeout_s=load_timeout,
                             client=load_client)
    if load is None and settings:
        raise UsageError("the --load-* options go with --load PROFILE")
    dopts = DiagnoseOptions(port=port, seconds=seconds, num_steps=steps, health_timeout=health_timeout,
                            load=load_options(settings) if load is not None else None, replay=trace)
    hosts = opts.select(pattern)
    with opts.fleet(opts.timeout or dopts.budget_s(1)) as fleet:
        results = diagnose_fleet(fleet, hosts, dopts, opts.timeout)
    _finish(results, opts.json_out, renderer("diagnose", {}))


def _gate_load(gate, declared, no_validate=False, **settings):
    """(--gate load asked, the command line's load settings, the LoadOptions a change gets when
    the playbook's load step (`declared`, None for none) or --gate load asks, else None).
    Raises UsageError for load options given with no load gate to use them, and for --gate
    with --no-validate (`no_validate`), which runs no gate."""
    from ..engine.load import load_options

    if no_validate and gate is not None:
        raise UsageError("--no-validate runs no gate: leave out --gate")
    given = load_settings(gate=gate, **settings)
    if gate is None and declared is None and given:
        raise UsageError("the --load-* and tolerance options go with --gate load (or a playbook's load step)")
    lo = load_options(declared or {}, given) if gate is not None or declared is not None else None
    return gate is not None, given, lo


@app.command()
@fleet_command(timeout=None, before="playbooks_dir")
def apply(opts: FleetOptions,
          playbook: Annotated[str, typer.Argument(help="Playbook name (see --playbooks-dir) or a path to a .yaml file.")],
          pattern: Pattern,
          check: Annotated[bool, typer.Option("--check", help="Check mode: report, change nothing.")] = False,
          diff: Annotated[bool, typer.Option("--diff", help="Print unified diffs, identical ones coalesced.")] = False,
          serial: Annotated[Optional[str], typer.Option("--serial", help="Rolling batches: N, P% or a list 1,25%,100%.")] = None,
          max_fail_percentage: Annotated[float, typer.Option("--max-fail-percentage",
                                         help="Stop the rollout when a batch fails more than this.")] = 0.0,
          yes: Yes = False, port: Port = config.DEFAULT_SGLANG_PORT,
          health_timeout: HealthTimeout = config.HEALTH_TIMEOUT_S, repeat: Repeat = 3,
          latency_tolerance: LatencyTolerance = 1.25, latency_slack: LatencySlack = None,
          allow_token_drift: AllowDrift = False, playbooks_dir: PlaybooksDir = None,
          install: InstallOpt = None, no_validate: NoValidate = False,
          export_patch: Annotated[Optional[Path], typer.Option("--export-patch", help=(
              "Write the plan as checked patch files into DIR (one per SGLang version and pre-image set) "
              "for image builds; implies --check."))] = None,
          pristine_dir: Annotated[Optional[Path], typer.Option("--pristine-dir", help=(
              "Release wheels (sglang-VERSION-*.whl) to check exported patches against, instead of the "
              "wheel cache."))] = None,
          gate: GateOpt = None, load_concurrency: LoadConcurrency = None, load_prompts: LoadPrompts = None,
          load_input_len: LoadInputLen = None, load_output_len: LoadOutputLen = None,
          load_timeout: LoadTimeout = None, load_client: LoadClient = None, load_repeat: LoadRepeat = None,
          max_throughput_drop: MaxThroughputDrop = None, max_itl_rise: MaxItlRise = None,
          itl_slack_ms: ItlSlackMs = None, max_ttft_rise: MaxTtftRise = None,
          ttft_slack_ms: TtftSlackMs = None) -> None:
    """Apply a playbook: plan, check mode and diff, rolling batches, validation gate, rollback.

    A check pass always comes first; only the hosts it finds to change are then applied, in
    --serial batches (so a canary batch is made of hosts that really change)."""
    from ..engine.playbooks.apply import ApplyOptions, check_then_apply
    from ..engine.fleet import parse_serial
    from ..paths import find_playbook
    from ..engine.playbooks.model import load_playbook
    from ..report.terminal import render_apply, render_handlers

    if not 0 <= max_fail_percentage <= 100:
        raise UsageError("--max-fail-percentage must be between 0 and 100")
    _positive(timeout=opts.timeout)
    pb = load_playbook(find_playbook(playbook, playbooks_dir))
    if pristine_dir is not None and export_patch is None:
        raise UsageError("--pristine-dir goes with --export-patch")
    check = check or export_patch is not None
    load_gate, load_given, lo = _gate_load(
        gate, next((v.load for v in pb.validate if v.step == "load"), None), no_validate, concurrency=load_concurrency,
        num_prompts=load_prompts, input_len=load_input_len, output_len=load_output_len, timeout_s=load_timeout,
        client=load_client, repeat=load_repeat, max_throughput_drop=max_throughput_drop, max_itl_rise=max_itl_rise,
        itl_slack_ms=itl_slack_ms, max_ttft_rise=max_ttft_rise, ttft_slack_ms=ttft_slack_ms)
    apply_opts = ApplyOptions(check=check, export=export_patch is not None, install=install, serial=serial,
                              max_fail_percentage=max_fail_percentage,
                              smoke=_smoke_opts(port, health_timeout, repeat, latency_tolerance,
                                                allow_token_drift, latency_slack),
                              load_gate=load_gate, load_settings=load_given, no_validate=no_validate)
    if not check and not no_validate:
        _fits_health_wait(opts.timeout, apply_opts.smoke, config.ROLLBACK_RESERVE_S)
    hosts = opts.select(pattern)

    def confirm(plan_results, to_change) -> None:
        if not opts.json_out:
            render_apply(plan_results, out, diff=True, check=True, title="plan (nothing is changed yet)")
            render_handlers(plan_results, out)
        _confirm(f"apply {pb.name} to {len(to_change)} host(s)", yes)

    try:
        parse_serial(serial, len(hosts))
    except ValueError as e:
        raise UsageError(f"--serial: {e}") from None
    load_budget = lo.budget_s(lo.repeat + 1) if lo else 0
    with opts.fleet(opts.timeout or config.smoke_job_timeout(health_timeout) + load_budget) as fleet:
        outcome = check_then_apply(fleet, hosts, pb, apply_opts, confirm, check_timeout=opts.timeout)
    if outcome.nothing_to_change:
        err.print("nothing to change")
    cid = outcome.change_id
    patches = []
    if export_patch is not None:
        from ..engine.playbooks.patches import write_patches
        patches = [str(p) for p in write_patches(outcome.results, pb.name, export_patch, pristine_dir)]
        for r in outcome.results:
            r.data.pop("texts", None)

    doc = {"change_id": cid, "check": check, **({"patches": patches} if export_patch is not None else {})}
    # an apply showed its diffs with the plan, before the confirmation
    _finish(outcome.results, opts.json_out, renderer("apply", doc, diff=diff and check), **doc)


@app.command()
@fleet_command(timeout=config.ROLLBACK_TIMEOUT_S, after="force", before="install")
def rollback(opts: FleetOptions,
             args: Annotated[list[str], typer.Argument(help="CHANGE-ID HOSTS, or HOSTS with --last.")],
             last: Annotated[bool, typer.Option("--last", help="Roll back each host's last applied change.")] = False,
             forget: Annotated[bool, typer.Option(
                 "--forget", help="Restore nothing: drop a change whose release an upgrade replaced (the tree is "
                 "checked first; files it created that the upgrade left are removed), then apply again.")] = False,
             force: Annotated[bool, typer.Option("--force", help="Restore even files changed since the apply.")] = False,
             yes: Yes = False, install: InstallOpt = None) -> None:
    """Restore the files of a change byte-identical (sha256 checked against the ledger)."""
    from ..engine.ledger import rollback_job

    if len(args) != (1 if last else 2):
        raise UsageError("usage: fleetctl rollback CHANGE-ID HOSTS, or fleetctl rollback --last HOSTS")
    if forget and (last or force):
        raise UsageError("--forget takes a CHANGE-ID (what status names), never --last or --force: "
                         "fleetctl rollback --forget CHANGE-ID HOSTS")
    if install and not last and install.startswith("host:"):
        raise UsageError("--install goes with --last, or names a container install (a CHANGE-ID already names "
                         "its host install; a container's ledger is inside it)")
    change_id, pattern = (None, args[0]) if last else (args[0], args[1])
    hosts = opts.select(pattern)
    _confirm(f"{'forget' if forget else 'roll back'} {change_id or 'the last change'} on {len(hosts)} host(s)", yes)
    with opts.fleet() as fleet:
        results = fleet.run(hosts, rollback_job(change_id, force, install=install, forget=forget), "rollback")
    _finish(results, opts.json_out, renderer("rollback", {}))


@app.command()
@fleet_command(timeout=config.ROLLBACK_TIMEOUT_S)
def recover(opts: FleetOptions, pattern: Pattern, yes: Yes = False) -> None:
    """Undo the changes a killed run left pending (and restart SGLang where there were any); apply nothing."""
    from ..engine.ledger import recover_job

    hosts = opts.select(pattern)
    _confirm(f"undo pending changes on {len(hosts)} host(s)", yes)
    with opts.fleet() as fleet:
        results = fleet.run(hosts, recover_job(), "recover")
    _finish(results, opts.json_out, renderer("recover", {}))


@app.command()
@fleet_command(timeout=config.STATUS_TIMEOUT_S, before="install")
def status(opts: FleetOptions, pattern: Pattern, install: InstallOpt = None) -> None:
    """Applied changes per host and drift (reverted changes, files modified outside fleetctl)."""
    from ..engine.ledger import status_job

    hosts = opts.select(pattern)
    with opts.fleet() as fleet:
        results = fleet.run(hosts, status_job(install=install), "status", last=True)
    _finish(results, opts.json_out, renderer("status", {}))


@cache_app.command("clear")
@fleet_command(timeout=config.STATUS_TIMEOUT_S)
def cache_clear(opts: FleetOptions, pattern: Pattern) -> None:
    """Empty each host's scan cache: scans, interpreters' answers, RECORD hashes, compiled probes and
    the interpreter record (the next inspect reads and parses every file again)."""
    from ..engine.gather import cache_clear_job

    hosts = opts.select(pattern)
    with opts.fleet() as fleet:
        results = fleet.run(hosts, cache_clear_job, "cache clear", last=True)
    _finish(results, opts.json_out, renderer("cache clear", {}))


@deploy_app.command("kernel")
@fleet_command(timeout=None, before="kernels_dir")
def deploy_kernel(opts: FleetOptions,
                  name: Annotated[str, typer.Argument(help="Kernel package NAME (see --kernels-dir).")],
                  pattern: Pattern, yes: Yes = False,
                  check: Annotated[bool, typer.Option("--check", help=(
                      "Check mode: preflight and build key per host (would it build, would it activate); "
                      "nothing is uploaded, built or activated."))] = False,
                  max_jobs: Annotated[int, typer.Option("--max-jobs", help="Parallel compile jobs per host.")] = 4,
                  backend: Annotated[Optional[str], typer.Option("--backend", metavar="cpu|cuda|triton", help=(
                      "Build this backend on every host (default per host: triton on a GPU host whose SGLang "
                      "interpreter imports triton, cuda on other GPU hosts, cpu without a GPU)."))] = None,
                  build_timeout: Annotated[float, typer.Option("--build-timeout", help="Seconds for one build.")]
                  = config.BUILD_DEADLINE_S,
                  route: Annotated[Optional[list[str]], typer.Option(
                      "--route", metavar="all|HEAD_DIM:GROUP:DRAFT_TOKENS:DTYPE[:MAX_BATCH]", help=(
                          "What the build's dispatch table routes to it, recorded as the operator's: all, or "
                          "shapes (repeatable or comma-separated; dtype float16|bfloat16|float32; MAX_BATCH: the "
                          "largest batch routed, default any). Default: measured on a GPU host, nothing without "
                          "one."))] = None,
                  port: Port = config.DEFAULT_SGLANG_PORT, health_timeout: HealthTimeout = config.HEALTH_TIMEOUT_S,
                  repeat: Repeat = 3, latency_tolerance: LatencyTolerance = 1.25, latency_slack: LatencySlack = None,
                  allow_token_drift: AllowDrift = False, kernels_dir: KernelsDir = None,
                  no_validate: NoValidate = False,
                  gate: GateOpt = None, load_concurrency: LoadConcurrency = None, load_prompts: LoadPrompts = None,
                  load_input_len: LoadInputLen = None, load_output_len: LoadOutputLen = None,
                  load_timeout: LoadTimeout = None, load_client: LoadClient = None, load_repeat: LoadRepeat = None,
                  max_throughput_drop: MaxThroughputDrop = None, max_itl_rise: MaxItlRise = None,
                  itl_slack_ms: ItlSlackMs = None, max_ttft_rise: MaxTtftRise = None,
                  ttft_slack_ms: TtftSlackMs = None) -> None:
    """Build kernels/NAME on each host for its GPU arch (or CPU), test it against its reference,
    publish it, activate it and its dispatch table (--route) atomically, validate (with --gate
    load, also under load: the report shows the speedup), and switch back on failure."""
    from ..engine.kernels.deploy import DeployOptions, run_deploy
    from ..engine.kernels.dispatch import RouteError, parse_route
    from ..engine.kernels.package import BACKENDS, load_package
    from ..paths import project_dir

    if max_jobs < 1:
        raise UsageError(f"--max-jobs must be at least 1, not {max_jobs}")
    if backend not in (None, *BACKENDS):
        raise UsageError(f"--backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    _positive(build_timeout=build_timeout, timeout=opts.timeout)
    try:
        routes = parse_route(route)
    except RouteError as e:  # the engine's reason; the flag is the CLI's to name
        raise UsageError(f"--route {e}" if e.spec is not None else f"--route: {e}") from None
    pkg = load_package(project_dir("kernels", kernels_dir), name)
    load_gate, load_given, lo = _gate_load(
        gate, None, no_validate, concurrency=load_concurrency, num_prompts=load_prompts, input_len=load_input_len,
        output_len=load_output_len, timeout_s=load_timeout, client=load_client, repeat=load_repeat,
        max_throughput_drop=max_throughput_drop, max_itl_rise=max_itl_rise, itl_slack_ms=itl_slack_ms,
        max_ttft_rise=max_ttft_rise, ttft_slack_ms=ttft_slack_ms)
    deploy_opts = DeployOptions(smoke=_smoke_opts(port, health_timeout, repeat, latency_tolerance, allow_token_drift,
                                                  latency_slack), max_jobs=max_jobs, build_timeout=build_timeout,
                                check=check, backend=backend, load_gate=load_gate, load_settings=load_given,
                                route=routes, no_validate=no_validate)
    if not check and not no_validate:
        _fits_health_wait(opts.timeout, deploy_opts.smoke, config.ROLLBACK_RESERVE_S)
    hosts = opts.select(pattern)
    if not check:
        _confirm(f"deploy kernel {pkg.name} {pkg.version} to {len(hosts)} host(s)", yes)
    load_budget = lo.budget_s(lo.repeat + 1) if lo else 0
    with opts.fleet(opts.timeout or config.deploy_job_timeout(build_timeout, health_timeout) + load_budget) as fleet:
        cid, results = run_deploy(fleet, hosts, pkg, deploy_opts)
    doc = {"change_id": cid, "kernel": pkg.name, **({"check": True} if check else {})}
    _finish(results, opts.json_out, renderer("deploy kernel", doc), **doc)


def renderer(command: str, doc: dict, diff: bool = False, details: bool = False):
    """How `command` (its words: "inspect", "deploy kernel", ...) prints its results: a function
    (results, console) made of the report room's renderers, given the rest of its `--json` document
    (`doc`: check, patches), whether an apply prints its diffs and an inspect its details. The
    commands print with it,
    and `history show` prints a recorded run again with it. Raises KeyError for another command."""
    from ..report import gates, terminal
    from ..report.text import text

    def render_diagnose(results, console) -> None:  # its imports (engine.diagnose: 34 ms) only for diagnose
        from ..report.diagnose import render_diagnose
        render_diagnose(results, console)

    own = {"inspect": lambda rs, console: terminal.render_inspect(rs, console, details=details),
           "validate": gates.render_validate, "rollback": terminal.render_rollback,
           "recover": terminal.render_recover, "status": terminal.render_status,
           "cache clear": terminal.render_cache_clear, "deploy kernel": terminal.render_deploy,
           "diagnose": render_diagnose,
           "apply": lambda rs, console: terminal.render_apply(rs, console, diff=diff, check=bool(doc.get("check")))}
    first = own[command]

    def render(results, console) -> None:
        first(results, console)
        if command == "validate":
            gates.render_load(results, console)
        if command in ("apply", "deploy kernel"):
            gates.render_gates(results, console)
        for p in doc.get("patches") or []:
            console.print(text(f"patch written: {p}"))

    return render


def _finish(results, json_out: bool, render, hosts: list[dict] | None = None, **doc) -> None:
    """Print the results (one JSON document: the envelope (report.document.envelope: schema
    version, run id, exit code), `doc` and "hosts", each result's to_json() unless `hosts` gives
    the entries; or `_render`), hand that document to the run's history record, and exit with
    Ansible's code for them."""
    from ..engine.fleet import exit_code
    from ..history import record
    from ..report.document import envelope

    document = envelope({**doc, "hosts": [r.to_json() for r in results] if hosts is None else hosts},
                        signals.exit_code(exit_code(results)), record.current_run_id())
    record.results(document)
    if json_out:
        _print_json(document)
    else:
        _render(results, render, doc.get("change_id"))
    raise typer.Exit(document["exit_code"])


def _render(results, render, change_id: str | None = None) -> None:
    """`render(results, out)`, the change id when there is one, and the recap line. A report that
    cannot be rendered is said so in one line; the change id and the recap follow it anyway."""
    from ..report.terminal import render_lasts, render_status_line
    from ..report.text import text

    try:
        render(results, out)
        render_lasts(results, out)
    except Exception as e:  # noqa: BLE001 - the change id and the exit code must still be given
        out.print(text(f"the report could not be rendered: {type(e).__name__}: {e}", style="red"))
    if change_id:
        out.print(text(f"change id: {change_id}"))
    render_status_line(results, out)


def _print_json(doc: dict) -> None:
    sys.stdout.write(json.dumps(doc, indent=1, default=str) + "\n")
