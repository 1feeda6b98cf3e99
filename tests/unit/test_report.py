"""Rendering: identical hosts coalesced into one row, host lists shortened with their count (review M4)."""

from __future__ import annotations

import io

from rich.console import Console

from fleetctl.engine.context import HostResult
from fleetctl.report.gates import render_validate
from fleetctl.report.terminal import render_deploy, render_handlers, render_inspect, render_status
from fleetctl.report.text import coalesce, host_list


def test_coalesce_groups_equal_values_in_first_seen_order():
    items = [("a", {"x": 1, "y": [1]}), ("b", {"x": 2}), ("c", {"y": [1], "x": 1}), ("d", {"x": 2}), ("e", None)]
    assert coalesce(items) == [(["a", "c"], {"x": 1, "y": [1]}), (["b", "d"], {"x": 2}), (["e"], None)]
    assert coalesce([]) == []


def test_host_list_gives_the_count_when_shortened():
    assert host_list(["a", "b"]) == "a, b"
    six = [f"h{i}" for i in range(6)]
    assert host_list(six) == "h0, h1, h2, h3, h4, h5"
    assert host_list(six + ["h6"]) == "h0, h1, h2, h3, h4, h5 … (+1 more; 7 hosts)"
    assert host_list([f"h{i}" for i in range(12)], limit=2) == "h0, h1 … (+10 more; 12 hosts)"


def inspected(host: str, version: str, origins: int) -> HostResult:
    """An inspect result as the inspect job returns it, for a host running SGLang `version`."""
    facts = {"python": {"path": "/opt/sglang/venv/bin/python", "version": "3.11.7"},
             "sglang": {"version": version, "location": "/opt/sglang/venv/lib/python3.11/site-packages"},
             "torch": None, "gpus": [], "gpus_reason": "no nvidia-smi", "servers": []}
    sites = [{"file": "sglang/srt/a.py", "line": 10, "end_line": 12, "callee": "TokenToKVPoolAllocator",
              "aliased": False, "need_sort": {"passing": "keyword", "expr": "flag"}}]
    found = [{"file": "sglang/srt/a.py", "line": 11 + i, "kind": "keyword", "callee": "TokenToKVPoolAllocator",
              "expr": "x in y", "literal": False} for i in range(origins)]
    return HostResult(host, host + ".example.invalid", "ok", elapsed_s=0.5,
                      data={"facts": facts, "allocator_call_sites": sites, "need_sort_origins": found})


def render(results, details: bool = True) -> str:
    out = io.StringIO()
    render_inspect(results, Console(file=out, width=400, color_system=None), details=details)
    return out.getvalue()


def test_render_inspect_coalesces_identical_hosts_into_one_row():
    text = render([inspected("gpu-01", "0.5.23", 1), inspected("gpu-02", "0.5.10", 1),
                   inspected("gpu-03", "0.5.23", 1),
                   HostResult("gpu-04", "gpu-04.example.invalid", "unreachable", error="connect timed out")])
    rows = [line for line in text.splitlines() if "0.5.23" in line or "0.5.10" in line]
    assert len(rows) == 2, text  # gpu-01 and gpu-03 share one row
    assert "gpu-01, gpu-03" in rows[0] and "gpu-02" not in rows[0]
    assert "gpu-02" in rows[1] and "gpu-01" not in rows[1]
    # the findings tables: one per distinct set of findings (all three hosts found the same here)
    assert "allocator call sites — gpu-01, gpu-02, gpu-03" in text
    assert "need_sort origins — gpu-01, gpu-02, gpu-03" in text
    # the unreachable host is listed with its error, not in the summary
    assert "problems" in text and "connect timed out" in text
    assert text.count("gpu-04") == 1


def test_render_inspect_says_no_need_sort_for_a_release_without_it():
    text = render([inspected("old-01", "0.4.6.post5", 0), inspected("old-02", "0.4.6.post5", 0)])
    assert "none: this release has no need_sort" in text
    assert "no need_sort origins: this release has no need_sort" in text
    assert "allocator call sites — old-01, old-02" in text and "need_sort origins —" not in text


HOSTILE = "[/INST] [bold red]FAKE OK[/] \x1b[1A\x1b[2K\x1b]52;c;aGk=\x07 \u202eevil"


def test_host_strings_are_text_with_control_characters_visible():
    """A model path, an error and call-site text holding Rich markup, ANSI/OSC escapes and a bidi
    override are printed as they are, escapes visible (security review M5)."""
    r = inspected("gpu-01", "0.5.23", 1)
    r.data["facts"]["servers"] = [{"port": 30000, "model_path": HOSTILE, "tp_size": 1}]
    r.data["allocator_call_sites"][0]["callee"] = HOSTILE
    bad = HostResult("gpu-02", "gpu-02.example.invalid", "failed", error="handler said " + HOSTILE)
    text = render([r, bad])
    assert "\x1b" not in text and "\u202e" not in text and "\x07" not in text
    shown = "[/INST] [bold red]FAKE OK[/] \\x1b[1A\\x1b[2K\\x1b]52;c;aGk=\\x07 \\u202eevil"
    assert text.count(shown) >= 2, text  # the summary's server cell and the call-site table
    assert "handler said [/INST]" in text


def test_odd_host_data_is_reported_not_a_crash():
    """Missing keys and wrong types from a host end in a "malformed" cell, and the other hosts'
    rows are still printed."""
    gpus = inspected("gpu-01", "0.5.23", 1)
    gpus.data["facts"]["gpus"] = [{"name": "H200", "compute_cap": None}, {"name": None}]
    sites = inspected("gpu-03", "0.5.2", 1)
    sites.data["allocator_call_sites"] = [{"file": "x.py"}]
    text = render([gpus, inspected("gpu-02", "0.5.10", 1), sites])
    assert "malformed data from the host: KeyError: 'compute_cap'" in text
    assert "malformed data from the host: KeyError: 'need_sort'" in text
    assert "gpu-03: malformed call sites from the host: KeyError: 'need_sort'" in text
    assert "0.5.10" in text and "allocator call sites — gpu-01, gpu-02" in text
    short = render([gpus, inspected("gpu-02", "0.5.10", 1), sites], details=False)
    assert "malformed data from the host: KeyError: 'compute_cap'" in short and "0.5.10" in short


def test_status_and_validate_tables_tolerate_odd_data():
    out = io.StringIO()
    console = Console(file=out, width=300, color_system=None)
    render_status([HostResult("h1", "a", "ok", data={"changes": [{"state": "applied"}], "sglang": HOSTILE}),
                   HostResult("h2", "b", "ok", data={"changes": [], "sglang": "0.5.2", "drift": None,
                                                     "modified": [{"path": HOSTILE}]})], console)
    render_validate([HostResult("h3", "c", "ok", data={"servers": [{"port": 1, "health_wait_s": "x"}]})], console)
    text = out.getvalue()
    assert "malformed data from the host: KeyError: 'change_id'" in text
    assert "\\x1b[1A" in text and "\x1b" not in text and "0.5.2" in text
    assert "malformed data from the host: ValueError: Unknown format code 'f'" in text


def test_validate_table_names_each_refused_target():
    """A process that claimed a server's port it does not hold is a row of its own, with the
    reason (review N6): the table does not hide what --json says."""
    out = io.StringIO()
    console = Console(file=out, width=300, color_system=None)
    refused = {"pid": 4242, "host": "127.0.0.1", "port": 30000,
               "reason": "port 30000 is held by pid 17, not by this server or its descendants"}
    render_validate([HostResult("h1", "a", "ok", data={"servers": [], "refused": [refused, {"pid": HOSTILE}]})], console)
    text = out.getvalue()
    assert "refused: pid 4242 127.0.0.1:30000" in text and refused["reason"] in text
    assert "\\x1b[1A" in text and "\x1b" not in text


def test_status_shows_the_space_the_state_dir_uses_and_the_unscanned_files():
    out = io.StringIO()
    console = Console(file=out, width=300, color_system=None)
    render_status([HostResult("h1", "a", "ok", data={"changes": [], "sglang": "0.5.2",
                                                     "space": {"backups": 3 << 20, "kernels": 80 << 20,
                                                               "total": (83 << 20) + 4096}}),
                   HostResult("h2", "b", "ok", data={"changes": [], "sglang": "0.5.2"})], console)
    text = out.getvalue()
    assert "backups 3.0 MiB, kernel builds 80.0 MiB (state dir 83.0 MiB)" in text
    [h2] = [line for line in text.splitlines() if "h2" in line]
    assert "?" in h2 and "MiB" not in h2  # a host that did not say is not shown as 0
    from fleetctl.report.terminal import _install_line
    line = _install_line({"sglang": {"version": "0.5.2", "install": "wheel", "package_dir": "/v/sglang"},
                          "scan": {"error": None, "parse_errors": [{"file": "sglang/srt/layers", "error": "x"}]}})
    assert line == "0.5.2 wheel /v/sglang (1 not scanned: see --json scan.parse_errors)"


def test_handlers_are_shown_with_the_plan_coalesced_and_redacted():
    def planned(host, cmd):
        return HostResult(host, "a", "changed", data={"plan": {"handlers": [{"name": "restart sglang",
                                                                           "command": cmd}]}})
    out = io.StringIO()
    render_handlers([planned("h1", "systemctl restart sglang"), planned("h2", "systemctl restart sglang"),
                     planned("h3", "HF_TOKEN=hf_x /opt/restart.sh [/x]"), HostResult("h4", "a", "ok", data={})],
                    Console(file=out, width=200, color_system=None))
    assert out.getvalue().splitlines() == [
        "handlers run after the change — h1, h2:", "  restart sglang: systemctl restart sglang",
        "handlers run after the change — h3:", "  restart sglang: HF_TOKEN=<redacted> /opt/restart.sh [/x]"]


def test_deploy_check_mode_says_what_would_happen_and_what_is_active_now():
    """Check mode activates nothing: a host that would change shows its active build (the
    previous key), one already on the key shows it; the build column says would build/reuse."""
    new, old = "a" * 64, "b" * 64
    base = {"check": True, "backend": "cpu", "arch": None, "build_key": new, "refusals": []}
    out = io.StringIO()
    render_deploy([HostResult("h1", "a1", "changed", data={**base, "previous": old, "reused": False}),
                   HostResult("h2", "a2", "ok", data={**base, "previous": new, "reused": True})],
                  Console(file=out, width=200))
    rows = {line.split("│")[1].strip(): line for line in out.getvalue().splitlines() if line.count("│") > 3}
    assert "would build" in rows["h1"] and old[:12] in rows["h1"] and new[:12] not in rows["h1"]
    assert "would reuse" in rows["h2"] and new[:12] in rows["h2"]


def test_a_table_title_from_host_data_has_its_escapes_visible():
    """`history show`'s tables are titled with recorded text: a terminal escape in a title is shown
    as \\x1b, not sent to the terminal (red-team review of issue 37, L5)."""
    from fleetctl.report.text import table

    out = io.StringIO()
    table("run \x1b[2J[bold]x[/]", ["a column wider than the title"], [["1"]], Console(file=out, width=200, color_system=None))
    assert "\x1b" not in out.getvalue() and "run \\x1b[2J[bold]x[/]" in out.getvalue()
