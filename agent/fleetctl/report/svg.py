"""The HTML report's pictures as inline SVG, drawn here: no JavaScript and no chart library, so a
chart shows with scripts off, in print and under a Content-Security-Policy that loads nothing.

    gate_bars(target, rows)           a load gate's baseline and after bars per gated metric
    measured(v), figure(v, unit)      a recorded figure as a float (None: not measured) and its label
    timeline(hosts, events, t0, t1)   the changes made to each host over time, one lane per host
    diagnose_bars(groups)             the diagnose roll-up: a stacked bar of device time per host group

The SVG is built with xml.etree.ElementTree, which escapes text and attribute values; every label
passes through report.visible first (control characters shown as \\xNN). Each data point is one
element of class "point" with a <title> (the browser's tooltip) and data-* attributes naming what
it shows, so a test counts and reads the points from the DOM. The output is deterministic (no
ids, no clock): the same data draws the same bytes.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from datetime import datetime, timezone

from markupsafe import Markup

from .text import visible

# The load gate's gated metrics (engine/gates/load.GATED, SGLang's result names), their labels, units
# and which way is better.
GATED = (("output_throughput", "output throughput", "tok/s", True),
         ("p99_ttft_ms", "p99 TTFT", "ms", False),
         ("p99_itl_ms", "p99 ITL", "ms", False))
PANEL_W, PANEL_H, BAR_W = 180, 160, 44
LANE_H, LABEL_W, TIMELINE_W = 28, 130, 900


def _el(parent: ET.Element, tag: str, text: str | None = None, **attrs) -> ET.Element:
    """A child element; attribute names lose a trailing "_" and "_" becomes "-" (class_: class,
    text_anchor: text-anchor); text and values pass through visible."""
    e = ET.SubElement(parent, tag, {k.rstrip("_").replace("_", "-"): visible(v) for k, v in attrs.items()})
    if text is not None:
        e.text = visible(text)
    return e


def _svg(width: float, height: float, label: str) -> ET.Element:
    return ET.Element("svg", {"width": f"{width:g}", "height": f"{height:g}", "viewBox": f"0 0 {width:g} {height:g}",
                              "role": "img", "aria-label": visible(label), "class": "chart"})


def _done(svg: ET.Element) -> Markup:
    return Markup(ET.tostring(svg, encoding="unicode", short_empty_elements=True))


def measured(v: object) -> float | None:
    """A recorded figure as a finite float, else None (not measured): a bool, a non-number, NaN,
    an infinity, or an int too large for a float (10**400) from a host's JSON."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except ArithmeticError:
        return None
    return f if math.isfinite(f) else None


def figure(v: float, unit: str) -> str:
    """A figure's label: two decimals under 100, whole numbers under a million, else three
    significant digits (1e+308, never a 309-digit label)."""
    return f"{v:.2f} {unit}" if abs(v) < 100 else f"{v:.0f} {unit}" if abs(v) < 1e6 else f"{v:.3g} {unit}"


def gate_bars(target: str, baseline: dict, after: dict, limits: dict, verdicts: dict) -> Markup:
    """One server's load gate: a panel per gated metric both runs measured, with the baseline's
    bar, the after run's bar (class "ok" or "breach" from `verdicts`, {metric: passed}) and the
    limit as a dashed line. baseline / after: SGLang's result dicts (output_throughput tok/s,
    p99_ttft_ms and p99_itl_ms ms); limits: {metric: the gate's limit} (engine/gates/load._server_gate).
    Two points per panel; a metric a run did not measure (see measured) draws no panel, and a
    negative figure draws at 0."""
    shown = [(k, name, unit, higher) for k, name, unit, higher in GATED
             if measured(baseline.get(k)) is not None and measured(after.get(k)) is not None]
    svg = _svg(max(1, len(shown)) * PANEL_W, PANEL_H, f"load gate of {target}: baseline and after")
    for n, (key, name, unit, higher) in enumerate(shown):
        g = _el(svg, "g", transform=f"translate({n * PANEL_W},0)", class_="panel")
        _el(g, "text", f"{name}, {unit}", x=PANEL_W / 2, y=12, class_="title", text_anchor="middle")
        _el(g, "text", f"{'higher' if higher else 'lower'} is better", x=PANEL_W / 2, y=25, class_="axis",
            text_anchor="middle")
        limit = measured(limits.get(key))
        top = min(max(measured(baseline[key]), measured(after[key]), limit or 0, 0) * 1.15, 1e308) or 1.0
        base_y, plot_h = PANEL_H - 22, PANEL_H - 62

        def y(v: float) -> float:
            return round(base_y - plot_h * (max(v, 0.0) / top), 2)

        for i, (phase, v) in enumerate((("baseline", measured(baseline[key])), ("after", measured(after[key])))):
            x = 35 + i * (BAR_W + 26)
            verdict = "" if phase == "baseline" or key not in verdicts else (" ok" if verdicts[key] else " breach")
            bar = _el(g, "rect", x=x, y=y(v), width=BAR_W, height=round(base_y - y(v), 2),
                      class_=f"point {phase}{verdict}", data_metric=key, data_phase=phase, data_value=f"{v:.6g}")
            _el(bar, "title", f"{target} {phase} {key}: {figure(v, unit)}")
            _el(g, "text", figure(v, unit), x=x + BAR_W / 2, y=y(v) - 3, class_="value", text_anchor="middle")
            _el(g, "text", phase, x=x + BAR_W / 2, y=PANEL_H - 8, class_="axis", text_anchor="middle")
        if limit is not None:
            line = _el(g, "line", x1=20, x2=PANEL_W - 10, y1=y(limit), y2=y(limit), class_="limit")
            _el(line, "title", f"limit: {figure(limit, unit)} ({'at least' if higher else 'at most'})")
        _el(g, "line", x1=20, x2=PANEL_W - 10, y1=base_y, y2=base_y, class_="baseline-axis")
    return _done(svg)


@dataclass(frozen=True)
class Event:
    """One host's result in a run that changes hosts. at: Unix seconds; status: the host's
    HostStatus word; label: what the tooltip says (the command, change id, outcome)."""

    host: str
    at: float
    status: str
    label: str
    command: str = ""


# The letter drawn in a timeline point for the command that made it (the page's legend lists
# them with the status colours), so that apply, deploy, rollback and recover read apart in
# print and mail, where no tooltip shows.
MARKS = {"apply": "A", "deploy kernel": "D", "rollback": "R", "recover": "C"}


def _utc(t: float, span: float) -> str:
    """A tick's label: month-day and the time, to the second when the span is under an hour."""
    return datetime.fromtimestamp(t, timezone.utc).strftime("%m-%d %H:%M" + (":%S" if span < 3600 else ""))


def timeline(hosts: list[str], events: list[Event], t0: float, t1: float) -> Markup:
    """The changes over time: a lane per host (in `hosts`' order), one circle per event at its
    time between t0 and t1 (Unix seconds, UTC ticks on the axis), of class "point" and the
    host's status word ("not attempted" as not-attempted), with its command's MARKS letter
    inside (a text of class "mark")."""
    width, height = TIMELINE_W, LANE_H * max(1, len(hosts)) + 30
    span = max(t1 - t0, 1.0)
    svg = _svg(width, height, "timeline of changes per host")

    def x(t: float) -> float:
        return round(LABEL_W + 20 + (width - LABEL_W - 90) * (t - t0) / span, 2)

    for i, host in enumerate(hosts):
        mid = LANE_H * i + LANE_H / 2
        _el(svg, "text", host, x=LABEL_W, y=mid + 4, class_="lane", text_anchor="end")
        _el(svg, "line", x1=LABEL_W + 10, x2=width - 20, y1=mid, y2=mid, class_="lane-line")
    axis_y = LANE_H * max(1, len(hosts)) + 14
    for k in range(5):
        t = t0 + span * k / 4
        _el(svg, "text", _utc(t, span) + ("Z" if k == 4 else ""), x=x(t), y=axis_y, class_="axis",
            text_anchor="middle")
    for e in events:
        if e.host not in hosts:
            continue
        dot = _el(svg, "circle", cx=x(e.at), cy=LANE_H * hosts.index(e.host) + LANE_H / 2, r=7,
                  class_=f"point {e.status.replace(' ', '-')}", data_host=e.host, data_status=e.status)
        _el(dot, "title", f"{e.host}: {e.label}")
        if e.command in MARKS:
            _el(svg, "text", MARKS[e.command], x=x(e.at), y=LANE_H * hosts.index(e.host) + LANE_H / 2 + 4,
                class_="mark", text_anchor="middle", data_command=e.command)
    return _done(svg)


# The diagnose roll-up's classes, in the order a stacked bar draws them (probes/diagnose/kernels.CLASSES
# and the device's wait on the host), each a CSS class of its own (fleet-report.css: .seg-N).
SEGMENTS = ("target_verify_attention", "extend_attention", "decode_attention", "moe_experts", "moe_routing",
            "dense_gemm", "communication", "sampling", "other", "unknown", "host_wait")
STACK_W, STACK_H, STACK_LABEL_W = 520, 22, 260


def diagnose_bars(groups: list[dict]) -> Markup:
    """The diagnose roll-up (engine/diagnose.groups): one stacked bar per host group (its verdict and
    servers as the label), a segment per class of SEGMENTS whose mean share is over 0 (the device
    time's classes scaled by the busy share, then the host wait), each of class "point seg-N" with
    data-verdict, data-class and data-share."""
    svg = _svg(STACK_LABEL_W + STACK_W + 10, len(groups) * (STACK_H + 8) + 48, "diagnose: device time per host group")
    for i, g in enumerate(groups):
        y = 4 + i * (STACK_H + 8)
        label = f"{g.get('verdict')}: {', '.join(map(str, g.get('servers') or []))}"
        _el(svg, "text", label[:60], x=0, y=y + STACK_H - 6, class_="axis")
        wait = measured(g.get("host_wait_share")) or 0.0
        shares = {k: (measured(v) or 0.0) * (1 - wait) for k, v in (g.get("shares") or {}).items()}
        shares["host_wait"] = wait
        x = float(STACK_LABEL_W)
        for n, seg in enumerate(SEGMENTS):
            v = max(0.0, min(1.0, shares.get(seg, 0.0)))
            if v <= 0:
                continue
            w = round(STACK_W * v, 2)
            r = _el(svg, "rect", x=round(x, 2), y=y, width=w, height=STACK_H, class_=f"point seg-{n}",
                    data_verdict=str(g.get("verdict")), data_class=seg, data_share=f"{v:.4f}")
            _el(r, "title", f"{g.get('verdict')}: {seg} {100 * v:.1f}%")
            x += w
    y = 4 + len(groups) * (STACK_H + 8)
    for n, seg in enumerate(SEGMENTS):  # the legend: four to a row
        lx, ly = (n % 4) * 190, y + (n // 4) * 14
        _el(svg, "rect", x=lx, y=ly, width=9, height=9, class_=f"seg-{n}")
        _el(svg, "text", seg.replace("_", " "), x=lx + 13, y=ly + 9, class_="axis")
    return _done(svg)
