"""Remote probe helper: the host's GPUs from nvidia-smi, healthy rows and lost devices apart.

Stdlib only (Python 3.8+), loaded by the facts and kbuild probe bundles. nvidia-smi(1) writes
the error of a lost or inaccessible GPU ("Unable to determine the device handle for GPU
0000:18:00.0: Unknown Error", from newer drivers "...for GPU0000:18:00.0: ...", "GPU is lost")
on stdout among the CSV rows of the healthy ones, and exits 0 or non-zero (RETURN VALUE: 15 a
GPU is lost, 18 NVML library mismatch...) depending on driver and query; an NVML that cannot
start prints its reason on stdout too. Values it cannot give are "[N/A]" or "[Not Supported]".
"""

import re
import subprocess

FIELDS = ["index", "pci.bus_id", "name", "memory.total", "driver_version", "compute_cap"]
QUERY = ",".join(FIELDS)
ARGS = ["--query-gpu=" + QUERY, "--format=csv,noheader,nounits"]  # nvidia-smi's, for parse()
# a PCI bus id; drivers print "for GPU 0000:18:00.0" and (newer ones) "for GPU0000:18:00.0"
_BUS_ID = re.compile(r"(?<![0-9A-Fa-f:])[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]\b")
_NULL = {"[N/A]", "[Not Supported]", "N/A", ""}
MAX_TEXT = 300  # characters kept of one nvidia-smi message


def _value(text):
    return None if text in _NULL else text


def _int(text):
    return int(text) if text.isdigit() else None


def parse(stdout, stderr, exit_code):
    """nvidia-smi ARGS (`--query-gpu=QUERY --format=csv,noheader,nounits`) output -> (gpus, gpu_errors,
    gpus_reason).

    gpus: [{index, pci_bus_id, name, memory_total_mib (MiB), driver, compute_cap}] for the rows
    that parse, unavailable values null; gpu_errors: [{index: int|None, pci_bus_id: str|None,
    error}] for each line that names a device (a bus id or "gpu N") and is no row;
    gpus_reason: None when every GPU answered, else a summary ("1 of 4 GPUs lost: 0000:18:00.0
    (...)", "nvidia-smi failed (exit 18): ..."), using stdout's text when stderr is empty."""
    gpus, devices, messages = [], [], []
    for line in stdout.splitlines():
        line = line.strip()
        if not line:
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == len(FIELDS) and parts[0].isdigit():
            idx, bus, name, mem, driver, cap = parts
            gpus.append({"index": int(idx), "pci_bus_id": _value(bus), "name": _value(name),
                         "memory_total_mib": _int(mem), "driver": _value(driver), "compute_cap": _value(cap)})
            continue
        bus = _BUS_ID.search(line)
        index = re.search(r"\bgpu (\d+)\b", line, re.I) if not bus else None
        if bus or index:
            devices.append({"index": int(index.group(1)) if index else None,
                            "pci_bus_id": bus.group(0) if bus else None, "error": line[:MAX_TEXT]})
        else:
            messages.append(line[:MAX_TEXT])
    messages += [l.strip()[:MAX_TEXT] for l in stderr.splitlines() if l.strip()]
    if devices:
        names = ", ".join(e["pci_bus_id"] or "index %d" % e["index"] for e in devices)
        reason = "%d of %d GPUs lost: %s (%s)" % (len(devices), len(gpus) + len(devices), names,
                                                  " | ".join([devices[0]["error"]] + messages)[:MAX_TEXT])
    elif exit_code != 0 or messages:
        reason = "nvidia-smi failed (exit %d): %s" % (exit_code, " | ".join(messages)[:MAX_TEXT] or "no output")
    else:
        reason = None
    return gpus, devices, reason


def gpu_facts(timeout=20):
    """Run nvidia-smi (see parse) within `timeout` seconds: (gpus, gpu_errors, gpus_reason)."""
    try:
        r = subprocess.run(["nvidia-smi"] + ARGS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
    except FileNotFoundError:
        return [], [], "nvidia-smi not found"
    except OSError as e:  # on PATH but not runnable by this user (a container entered as its user)
        return [], [], "nvidia-smi could not run: %s" % (e.strerror or e)
    except subprocess.TimeoutExpired:
        return [], [], "nvidia-smi did not answer within %d s" % timeout
    return parse(r.stdout.decode("utf-8", "replace"), r.stderr.decode("utf-8", "replace"), r.returncode)
