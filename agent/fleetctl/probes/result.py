"""How a probe's result is framed in its output: a MARKER line, then the result as one JSON text.

Stdlib only (Python 3.8+). The probe wrapper (probes.WRAPPER) prints the marker after whatever
the probe's children wrote to stdout; fleetctl (probes.parse_output) and the facts probe reading
an install interpreter's answer (facts.ask) take the text after the last marker line.
"""

MARKER = "--fleetctl-probe-result--"


def after_marker(text):
    """The text after the last MARKER line of probe output `text` (the result's JSON text), or
    None when there is no marker line."""
    idx = text.rfind(MARKER + "\n")
    return None if idx < 0 else text[idx + len(MARKER) + 1:]
