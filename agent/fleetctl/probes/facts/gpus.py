"""Remote probe helper: the host's GPUs from nvidia-smi, healthy rows, faulted ones and lost devices apart.

Stdlib only (Python 3.8+), loaded by the facts and kbuild probe bundles. nvidia-smi(1) writes
the error of a lost or inaccessible GPU ("Unable to determine the device handle for GPU
0000:18:00.0: Unknown Error", from newer drivers "...for GPU0000:18:00.0: ...", "GPU is lost")
on stdout among the CSV rows of the healthy ones, and exits 0 or non-zero (RETURN VALUE: 15 a
GPU is lost, 18 NVML library mismatch...) depending on driver and query; an NVML that cannot
start prints its reason on stdout too. A field nvidia-smi cannot give is written in brackets
(nvidia-smi(1), --query-gpu: "[N/A]", "[Not Supported]"; a failing NVML call gives its
nvmlErrorString() bracketed: "[Unknown Error]" (enkore/i3pystatus#850, Quake4/MindMiner#627),
"[GPU is lost]", "[GPU requires reset]", "[Insufficient Permissions]"): such a row is a GPU in
an error state (faulted), never a healthy GPU or an architecture, except an unavailable
memory.total (OPTIONAL: a GB10's unified memory answers "[N/A]").
The query runs through bounded.run: a nvidia-smi stuck in the driver (state D) is left behind.
"""

import re
import shutil

from .. import bounded

FIELDS = ["index", "pci.bus_id", "name", "memory.total", "driver_version", "compute_cap"]
QUERY = ",".join(FIELDS)
ARGS = ["--query-gpu=" + QUERY, "--format=csv,noheader,nounits"]  # nvidia-smi's, for parse()
# a PCI bus id; drivers print "for GPU 0000:18:00.0" and (newer ones) "for GPU0000:18:00.0"
_BUS_ID = re.compile(r"(?<![0-9A-Fa-f:])[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]\b")
_NULL = {"[N/A]", "[Not Supported]", "N/A", ""}
# fields that may be unavailable on a healthy GPU (a GB10's memory.total is "[N/A]"); any other
# field's bracketed or empty value makes the row a faulted GPU
OPTIONAL = {"memory.total"}
MAX_TEXT = 300  # characters kept of one nvidia-smi message
SMI_DEADLINE_S = 20  # the GPU query's own limit (bounded.limit: less when the host's deadline is nearer)
STUCK_HINT = "the driver is stuck: see dmesg for Xid"


def _int(text):
    return int(text) if text.isdigit() else None


def faults(parts):
    """{field: value} of a CSV row's (FIELDS order) values that make it a faulted GPU: bracketed
    ("[Unknown Error]", "[GPU requires reset]", "[N/A]"...) or empty, except OPTIONAL fields
    that are only unavailable ("[N/A]", "[Not Supported]"); {} for a healthy row."""
    out = {}
    for field, value in zip(FIELDS, parts):
        bracketed = value.startswith("[") and value.endswith("]")
        if (bracketed or value in _NULL) and not (field in OPTIONAL and value in _NULL):
            out[field] = value
    return out


def _row(parts):
    """A CSV row of FIELDS: its index is a number, or bracketed when nvidia-smi could not read it."""
    return len(parts) == len(FIELDS) and (parts[0].isdigit() or parts[0].startswith("["))


def parse(stdout, stderr, exit_code):
    """nvidia-smi ARGS (`--query-gpu=QUERY --format=csv,noheader,nounits`) output -> (gpus, gpu_errors,
    gpus_reason).

    gpus: [{index, pci_bus_id, name, memory_total_mib (MiB), driver, compute_cap}] for the healthy
    rows, unavailable OPTIONAL values null; gpu_errors: [{index: int|None, pci_bus_id: str|None,
    error}] for each line that names a device (a bus id or "gpu N") and is no row (a lost GPU),
    and [{index, pci_bus_id, error, faults: {field: value}}] for each faulted row (see faults;
    error "GPU 1 (00000000:3B:00.0): compute_cap [GPU requires reset]"); gpus_reason: None when
    every GPU answered, else a summary ("1 of 4 GPUs lost: 0000:18:00.0 (...)", "1 of 2 GPUs
    faulted: GPU 1 (...): ...", "nvidia-smi failed (exit 18): ..."), using stdout's text when
    stderr is empty."""
    gpus, devices, faulted, messages = [], [], [], []
    for line in stdout.splitlines():
        line = line.strip()
        if not line:
            continue
        parts = [p.strip() for p in line.split(",")]
        if _row(parts):
            idx, bus, name, mem, driver, cap = parts
            bad = faults(parts)
            if bad:
                index = int(idx) if idx.isdigit() else None
                bus_id = None if "pci.bus_id" in bad else bus
                what = "GPU %s" % (index if index is not None else "?") + (" (%s)" % bus_id if bus_id else "")
                faulted.append({"index": index, "pci_bus_id": bus_id, "faults": bad,
                                "error": ("%s: %s" % (what, ", ".join("%s %s" % kv for kv in bad.items())))[:MAX_TEXT]})
                continue
            gpus.append({"index": int(idx), "pci_bus_id": bus, "name": name,
                         "memory_total_mib": _int(mem), "driver": driver, "compute_cap": cap})
            continue
        bus = _BUS_ID.search(line)
        index = re.search(r"\bgpu (\d+)\b", line, re.I) if not bus else None
        if bus or index:
            devices.append({"index": int(index.group(1)) if index else None,
                            "pci_bus_id": bus.group(0) if bus else None, "error": line[:MAX_TEXT]})
        else:
            messages.append(line[:MAX_TEXT])
    messages += [l.strip()[:MAX_TEXT] for l in stderr.splitlines() if l.strip()]
    total, reasons = len(gpus) + len(devices) + len(faulted), []
    if devices:
        names = ", ".join(e["pci_bus_id"] or "index %d" % e["index"] for e in devices)
        first = " | ".join([devices[0]["error"]] + messages)[:MAX_TEXT]
        reasons.append("%d of %d GPUs lost: %s (%s)" % (len(devices), total, names, first))
    if faulted:
        named = "; ".join(e["error"] for e in faulted)[:MAX_TEXT]
        reasons.append("%d of %d GPUs faulted: %s" % (len(faulted), total, named))
    if not reasons and (exit_code != 0 or messages):
        reasons.append("nvidia-smi failed (exit %d): %s" % (exit_code, " | ".join(messages)[:MAX_TEXT] or "no output"))
    return gpus, devices + faulted, "; ".join(reasons) or None


def gpu_facts(smi="nvidia-smi", cap_s=SMI_DEADLINE_S):
    """Run `smi` (nvidia-smi, or its path) with ARGS through bounded.run (at most
    bounded.limit(cap_s) seconds, + bounded.GRACE_S when it must be left behind): (gpus,
    gpu_errors, gpus_reason) as parse says, or ([], [], why) when it is not found, cannot run,
    does not answer in time ("nvidia-smi (pid N, state D: uninterruptible sleep) did not answer
    within 20 s ...; the driver is stuck: see dmesg for Xid"), or one left behind by an earlier
    run is still stuck (it is not started again)."""
    found = shutil.which(smi)
    if not found:
        return [], [], "nvidia-smi not found"
    try:
        r = bounded.run([found] + ARGS, cap_s, name="nvidia-smi")
    except OSError as e:  # on PATH but not runnable by this user (a container entered as its user)
        return [], [], "nvidia-smi could not run: %s" % (e.strerror or e)
    if r.error:
        return [], [], r.error + ("; " + STUCK_HINT if r.state == "D" else "")
    return parse(r.stdout, r.stderr, r.returncode)
