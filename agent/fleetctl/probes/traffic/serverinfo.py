"""Remote probe: each SGLang server's shape facts for the measured dispatch table (engine/kernels/measure.py).

For each server target (targets.pick over the facts probe's servers, the inventory's fleetctl_sglang_port /
_host: the smoke decode's rule, loopback or this host's own addresses only), with the inventory's API key:

1. `/server_info` (or `/get_server_info` before 0.5), at most smoke.MAX_BODY bytes: KEYS, as ServerArgs names
   them (0.5.23 sglang/srt/arg_groups/fields/: parallel.py:45 tp_size, :73 dp_size, :194
   enable_dp_attention; spec.py:31 speculative_algorithm, :62 speculative_eagle_topk, :66
   speculative_num_draft_tokens; schedule.py:143 page_size; model.py:51 model_path, :110 context_length,
   :160 dtype, :197 kv_cache_dtype; exec_.py:207 attention_backend, :629 cuda_graph_max_bs_decode),
   each kept only when of its type and range (hostile values dropped to None);
2. `config.json` under model_path when model_path is an absolute, normalised local directory, read as
   the server's own effective uid (runas.read_as, review R4-7): reached from / without following a link
   (safefs.read_file), a regular file of at most MAX_CONFIG bytes (1 MiB), parsed as JSON; CONFIG_KEYS
   kept when ints in range or dtype strings (of text_config too). A hub id (not a local directory) or a
   link on the way is not read: the server's error says so, in fixed words (no host text: it may reach
   the world-readable dispatch table).

Stdlib only (Python 3.8+). Never raises for a server's or a file's faults: they land in `error`.
"""

import json
import os

from . import smoke
from .. import runas, safefs
from ..facts import targets

MAX_CONFIG = 1 << 20     # bytes of config.json read at most
MAX_INT = 1 << 20
KEYS = (("tp_size", int), ("dp_size", int), ("enable_dp_attention", bool), ("speculative_algorithm", str),
        ("speculative_num_draft_tokens", int), ("speculative_eagle_topk", int), ("page_size", int),
        ("kv_cache_dtype", str), ("dtype", str), ("model_path", str), ("context_length", int),
        ("attention_backend", str), ("cuda_graph_max_bs", int), ("cuda_graph_max_bs_decode", int))
CONFIG_INTS = ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size")
CONFIG_STRS = ("torch_dtype", "dtype")


def _keep(v, kind):
    """v when of `kind` (bool is no int), an int in 0..MAX_INT, a string of at most 512 characters; else None."""
    if kind is bool:
        return v if type(v) is bool else None
    if kind is int:
        return v if type(v) is int and 0 <= v <= MAX_INT else None
    return v if isinstance(v, str) and len(v) <= 512 else None


def pick_info(body):
    """KEYS of a /server_info answer, each _keep'ed."""
    return {k: _keep(body.get(k), kind) for k, kind in KEYS}


def pick_config(doc):
    """CONFIG_INTS and CONFIG_STRS of a parsed config.json, and of its text_config (a dict), _keep'ed."""
    out = {k: _keep(doc.get(k), int) for k in CONFIG_INTS}
    out.update({k: _keep(doc.get(k), str) for k in CONFIG_STRS})
    text = doc.get("text_config")
    if isinstance(text, dict):
        out["text_config"] = pick_config({k: v for k, v in text.items() if k != "text_config"})
    return out


def read_config(model_path, pid):
    """(config, None) or (None, why) for config.json in directory model_path (the module docstring),
    read as server `pid`'s effective uid, gid and groups (runas.read_as: review R4-7; the server
    reads it so itself). `why` is one of a few fixed phrases: it may reach the world-readable
    dispatch table, so no text of the host's (a path, an error, a value) is in it."""
    if not isinstance(model_path, str) or not model_path.startswith("/") or os.path.normpath(model_path) != model_path:
        return None, "model_path is not an absolute local directory (a hub id?): config.json not read"
    ids = runas.ids_of(pid)
    if ids is None:
        return None, "the server exited: config.json not read"
    try:
        data = runas.read_as(runas.Account(ids[0], ids[1], ids[2], "server pid %d" % pid),
                             model_path.rstrip("/") + "/config.json", MAX_CONFIG)
    except (OSError, safefs.UnsafePath):
        return None, "config.json not readable as the server's uid (missing, a link on its path, or over 1 MiB)"
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return None, "config.json is not JSON"
    if not isinstance(doc, dict):
        return None, "config.json is not a JSON object"
    return pick_config(doc), None


def server_info(base, timeout):
    """(pick_info of base/server_info or /get_server_info, None) or (None, why)."""
    for path in ("/server_info", "/get_server_info"):
        try:
            status, body = smoke._request(base + path, timeout=timeout)
        except OSError as e:
            last = str(e)[:200]
            continue
        if status == 200 and isinstance(body, dict):
            return pick_info(body), None
        last = "HTTP %s" % status
    return None, "neither /server_info nor /get_server_info answered an object (%s)" % last


def main(params):
    """params: servers (targets.live selectors: [{pid, python, port, host}]), port, host (the inventory's),
    api_key (sent to the targets only, never returned), request_timeout (30 s).
    Returns {"servers": [{pid, host, port, server_info: pick_info | None, config: pick_config | None,
    error}], "refused": targets' refusals}."""
    smoke.API_KEY = params.get("api_key")
    timeout = float(params.get("request_timeout", 30))
    picked = targets.pick(params.get("servers") or [], params.get("port"), params.get("host"), params.get("server_user"))
    out = []
    for t in picked["targets"]:
        if t.get("node_rank"):
            continue  # a non-zero-rank node answers /health only; rank 0's host gives the shape
        base = "http://%s:%d" % (t["host"] if ":" not in t["host"] else "[%s]" % t["host"], int(t["port"]))
        info, why = server_info(base, timeout)
        config = None
        if info is not None:
            config, why = read_config(info.get("model_path"), t["pid"])
        out.append({"pid": t["pid"], "host": t["host"], "port": int(t["port"]), "server_info": info, "config": config,
                    "error": why})
    return {"servers": out, "refused": picked["refused"]}
