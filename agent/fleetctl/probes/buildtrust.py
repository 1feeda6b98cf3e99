"""Whether a published verify_attention build may be loaded, and what its dispatch table routes:
the one text that both route-verify-attention's hook and the verify_attention_route finding run.

The finding (facts/verifyroute.py) imports this module in the facts probe; the hook's template
(playbooks/templates/route-verify-attention/fleetctl_verify.py.j2) includes this file's text in
the module it writes into SGLang's package, where the server's own process runs it. So the
finding's kernel.active never says yes where the hook refuses, and the keywords the finding
demands of an extend call are the ones the hook takes out of it.

Stdlib only (Python 3.8+), no import of fleetctl's: in the rendered hook these names are module
globals beside the hook's own (tests/unit/test_route_hook.py checks that none is defined twice).

- NEEDED: the keywords the hook cannot serve a call without, in the order its verify_fwd takes
  them out of the call (extend_attention_fwd's names for them, 0.4.6 to 0.5.23; the finding
  refuses an install whose extend call does not pass all of them).
- walk(link): the trust walk over the build `link` (PUBLIC/verify_attention/current) names;
  check(path, top) for each path on it; Untrusted says why not.
- table(path, key): what PUBLIC/verify_attention/dispatch.json (schema SCHEMA, written by
  `fleetctl deploy kernel`, engine/kernels/dispatch.py) routes for build `key`.
"""

import json
import os
import stat

NEEDED = ("q_extend", "k_extend", "v_extend", "o_extend", "k_buffer", "v_buffer", "qo_indptr", "kv_indptr",
          "kv_indices", "custom_mask", "is_causal", "mask_indptr", "max_len_extend")
OWNERS = (0,)  # who may own each path of the trust walk: root
SCHEMA = "fleetctl-dispatch/1"
DTYPES = ("float16", "bfloat16", "float32")


class Untrusted(Exception):
    """The build is not one this process may load; the message says why."""


def check(path, top):
    """Raise Untrusted unless `path` (absolute; lstat'ed, so a symbolic link is one) belongs to
    root (OWNERS) and only root may write it; a root-owned sticky directory strictly above `top`
    may be writable by others (no one else can rename what root made in it). Raises OSError
    when `path` cannot be lstat'ed."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise Untrusted("%s is a symbolic link" % path)
    if st.st_uid not in OWNERS:
        raise Untrusted("%s belongs to uid %d, not root" % (path, st.st_uid))
    above = top.startswith(path.rstrip("/") + "/")
    if st.st_mode & 0o022 and not (above and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
        raise Untrusted("%s is writable by group or others (mode %o)" % (path, stat.S_IMODE(st.st_mode)))


def walk(link):
    """The trust walk over the build `link` (PUBLIC/verify_attention/current) names: every path
    component from / to the package directory PUBLIC/verify_attention, the build directory and
    everything in it (never through a link), and the package's dispatch.json when it is there
    (a regular file), each check'ed; `current` names a directory beside it and PASSED's module
    lies in that build's build/. Returns (key, build dir, module path, dispatch.json's path:
    there or not). Raises Untrusted (why), OSError."""
    pkg = os.path.dirname(link)
    done = ""
    for part in [p for p in pkg.split("/") if p]:
        done += "/" + part
        check(done, pkg)
    try:
        key = os.readlink(link)
    except OSError as e:
        raise Untrusted("%s: %s: run `fleetctl deploy kernel verify_attention HOST` first" % (link, e.strerror))
    if "/" in key or key in (".", ".."):
        raise Untrusted("%s points at %s, not at a build beside it" % (link, key))
    bdir = os.path.join(pkg, key)
    if not os.path.lexists(bdir):
        raise Untrusted("%s points at %s, which is not there" % (link, key))
    check(bdir, pkg)
    for d, dirs, files in os.walk(bdir):  # the build's own files, never through a link (check refuses one)
        for name in [""] + dirs + files:
            check(os.path.join(d, name) if name else d, pkg)
    with open(os.path.join(bdir, "PASSED")) as f:
        module = f.read().strip()
    if os.path.dirname(module) != os.path.join(bdir, "build") or not os.path.isfile(module):
        raise Untrusted("PASSED of %s names %s, not a module in %s/build" % (bdir, module, bdir))
    dispatch = os.path.join(pkg, "dispatch.json")
    if os.path.lexists(dispatch):
        check(dispatch, pkg)
        if not stat.S_ISREG(os.lstat(dispatch).st_mode):
            raise Untrusted("%s is not a regular file" % dispatch)
    return key, bdir, module, dispatch


def table(path, key):
    """What the dispatch table at `path` routes for build `key` (the one `current` names): (all:
    bool, {(head_dim, group, draft_tokens, dtype): max_batch, None for any batch}, why nothing
    routes, or None). Nothing routes without a table, from one that is not SCHEMA's or cannot
    be read, from another build's, or from one enabling no shape; entries of one shape merge to
    the largest max_batch. Never raises."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        return False, {}, "there is no dispatch table %s" % path
    except (OSError, ValueError) as e:
        return False, {}, "the dispatch table %s cannot be read: %s: %s" % (path, type(e).__name__, e)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        return False, {}, "%s is not a %s table" % (path, SCHEMA)
    if doc.get("build") != key:
        return False, {}, "%s is the table of build %s, and current names %s" % (path, doc.get("build"), key)
    entries = doc.get("entries")
    if type(doc.get("all")) is not bool or not isinstance(entries, list):
        return False, {}, "%s: its all is not true or false, or its entries not a list" % path
    shapes = {}
    for e in entries:
        v = [e.get(n) if isinstance(e, dict) else None for n in ("head_dim", "group", "draft_tokens", "max_batch")]
        if not (all(type(n) is int and n >= 1 for n in v[:3]) and (v[3] is None or type(v[3]) is int and v[3] >= 1)
                and e.get("dtype") in DTYPES):
            return False, {}, "%s: entry %s is not {head_dim, group, draft_tokens: int >= 1, dtype: %s, max_batch: " \
                "int >= 1 or null}" % (path, json.dumps(e), " | ".join(DTYPES))
        shape = (v[0], v[1], v[2], e["dtype"])
        had = shapes.get(shape, 0)
        shapes[shape] = None if had is None or v[3] is None else max(had, v[3])
    if not doc["all"] and not shapes:
        return False, {}, "%s enables no shape (source %s: %s)" % (path, doc.get("source"), doc.get("why"))
    return doc["all"], shapes, None
