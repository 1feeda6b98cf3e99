"""Remote probe helper: where SGLang's Triton target verify can be routed to the deployed
verify_attention kernel, and whether that kernel can serve this install (the
`route-verify-attention` playbook's finding, `verify_attention_route`).

Stdlib only (Python 3.8+), loaded by the facts probe bundle (facts.main calls route() per install).
Everything is read from the install's own files with `ast`, never from a version table, so a
release the playbook was never shown is judged by what its code says:

- the anchor: the one call inside `TritonAttnBackend.forward_extend` (of
  sglang/srt/layers/attention/triton_backend.py) that reaches SGLang's Triton extend kernel:
  `self.<attr>(...)` where `self.<attr>` is bound in the class to `extend_attention_fwd` as
  is or as `torch.compiler.disable(extend_attention_fwd)` / `torch._dynamo.disable(...)` (one
  argument, no keyword; any other binding naming it, such as functools.partial(..., logit_cap=
  ...), is refused: it would bind keywords the guard never sees), or `self.<wrapper>(...)`
  where the wrapper is a method `def w(self, a1..an, *args, **kwargs)` (no defaults, no
  keyword-only parameters) whose body is only `if C: return X` statements (no else) and then
  `return self.<attr>(*args, **kwargs)`, each C reading only self's attributes and constants
  through comparisons, `not`, `and`, `or` (no call). Such a wrapper reaches the kernel, with its
  *args and **kwargs unchanged, exactly when every C is false; the guard, which stands before
  the call of the wrapper, routes only then: it carries `and not (C)` for each (the anchor's
  "unless"; 0.5.23's `_forward_extend_kernel(self, layer, ...)`: `self.dllm_attention is not
  None`; its n leading arguments are the wrapper's own). A wrapper of any other shape that
  forward_extend calls is refused. The call must be a statement of its own line, followed in
  its block by `return EXPR`; it may not pass `*x` or `**x`.
- the signature: `extend_attention_fwd`'s parameters in the module the backend imports it
  from; each argument of the anchor is named by it (positional ones by position), so each
  release's scale and logit cap are passed under their own names. Refused unless those names
  include all of buildtrust.NEEDED (the 13 the hook cannot serve a call without: a release that
  renamed max_len_extend, or an extend call that leaves one out, is refused, not guarded).
- the kernel: the published build PUBLIC/verify_attention/current names (PUBLIC_DIR, the
  control side's config.PUBLIC_KERNELS_DIR), trusted by the hook's own trust walk
  (buildtrust.walk: the hook's template includes that module's text), its PASSED (the module
  path), the build's record of the torch it was made with (build/build.ninja,
  torch.utils.cpp_extension's, for the cpu and cuda builds; build/kernels/manifest.json for the
  triton build) and PUBLIC/verify_attention/dispatch.json read as the hook reads it
  (buildtrust.table); whether the install's torch is that torch.
- the servers of the install: each one's uid and the attention backend its command line names.

route() returns {"file", "hook_file", "anchor" (None when refused), "refused" (why, or None),
"signature", "guard" and "import" (insertion sites: {"line", "indent", "present": the text
already there carrying our marker, or None}), "forward_batch" (forward_extend's parameter
name), "kernel", "servers", "files" ({rel: {sha256, size}}), "sources" ({rel: text}, only
with_sources)}.
"""

import ast
import hashlib
import json
import os
import re

from .. import buildtrust
from . import callsites, topology

BACKEND = "sglang/srt/layers/attention/triton_backend.py"
HOOK = "sglang/srt/layers/attention/fleetctl_verify.py"
CLASS = "TritonAttnBackend"
METHOD = "forward_extend"
KERNEL_NAME = "extend_attention_fwd"
HOOK_NAME = "_fleetctl_verify_fwd"  # the name the guard calls, bound by the inserted import
PACKAGE = "verify_attention"
# where deploy publishes builds (root 0755, world-readable): the host-side copy of the control
# side's config.PUBLIC_KERNELS_DIR (tests/unit/test_verifyroute.py checks they agree)
PUBLIC_DIR = "/var/lib/fleetctl-kernels"
# torch.utils.cpp_extension's build.ninja names the torch headers it compiled against
_TORCH_INCLUDE = re.compile(r"-isystem\s+(\S+)/include/torch/csrc/api/include(?:\s|$)")
_ARCH = re.compile(r"arch=compute_(\d+)")


class Refused(Exception):
    """The install's code is not what the guard can be inserted into; the message says why."""


def _parse(rel, text):
    return callsites._Source(rel, text, ast.parse(text, filename=rel))


def _own_line(src, node):
    """`node` (a statement) starts its line after indentation only: its indentation string."""
    start = src.line_starts[node.lineno - 1]
    col = src.char_col(node.lineno, node.col_offset)
    head = src.text[start:start + col]
    if head.strip():
        raise Refused("%s:%d: the extend call shares its line with other code" % (src.rel, node.lineno))
    return head


def _lines(src, first, last):
    """The text of lines first..last (1-based, inclusive), line breaks included."""
    end = src.line_starts[last] if last < len(src.line_starts) else len(src.text)
    return src.text[src.line_starts[first - 1]:end]


def _calls_in(fn):
    """Calls in function `fn`'s own body (not in nested functions, lambdas or classes), each
    with the statement that holds it and that statement's block ([stmt])."""
    out = []

    def visit(node, stmt, block):
        for field, value in ast.iter_fields(node):
            children = value if isinstance(value, list) else [value]
            is_block = isinstance(value, list) and value and all(isinstance(c, ast.stmt) for c in value)
            for child in children:
                if not isinstance(child, ast.AST):
                    continue
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                    continue
                s, b = (child, value) if is_block else (stmt, block)
                if isinstance(child, ast.Call):
                    out.append((child, s, b))
                visit(child, s, b)

    visit(fn, None, None)
    return out


def _self_attr(func):
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
        return func.attr
    return None


def _kernel_binding(tree):
    """(module, the name extend_attention_fwd is bound to) of the `from M import
    extend_attention_fwd [as N]` in the file (module level or in a function); Refused unless
    exactly one such module is named."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                if a.name == KERNEL_NAME:
                    found.add((node.module, a.asname or a.name))
    if len(found) != 1:
        raise Refused("%s imports %s from %d places (%s), not one" % (
            BACKEND, KERNEL_NAME, len(found), ", ".join(sorted(m for m, _ in found)) or "none"))
    return found.pop()


_DISABLE = ("torch.compiler.disable", "torch._dynamo.disable")  # wrappers that bind no argument


def _dotted(node):
    """"a.b.c" of a Name/Attribute chain, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return head + "." + node.attr if head else None
    return None


def _kernel_attrs(src, cls, local):
    """Attributes `self.X` the class binds to `local` (the imported kernel): as is, or as
    `torch.compiler.disable(local)` / `torch._dynamo.disable(local)` (one argument, no keyword).
    Refused for any other binding of self.X whose value names `local` (functools.partial(local,
    logit_cap=...) would bind keywords the guard never sees)."""
    attrs = set()
    for node in ast.walk(cls):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        attr = _self_attr(node.targets[0])
        v = node.value
        if not attr or not any(isinstance(n, ast.Name) and n.id == local for n in ast.walk(v)):
            continue
        if isinstance(v, ast.Call) and _dotted(v.func) in _DISABLE and len(v.args) == 1 and not v.keywords:
            v = v.args[0]
        if not (isinstance(v, ast.Name) and v.id == local):
            raise Refused("%s:%d: self.%s is bound to %s, not to %s as is or in %s(%s): what it binds the guard "
                          "would not pass" % (BACKEND, node.lineno, attr, src.segment(node.value), local,
                                              " / ".join(_DISABLE), local))
        attrs.add(attr)
    return attrs


def _self_only(expr):
    """`expr` reads only `self`'s attributes and constants through comparisons and boolean
    operators (no call, no subscript, no other name): evaluating it again in forward_extend,
    where `self` is the same object, gives what the wrapper saw."""
    ok = (ast.Expression, ast.Attribute, ast.Constant, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.Load, ast.cmpop,
          ast.boolop, ast.Not)
    return all(isinstance(n, ok) or (isinstance(n, ast.Name) and n.id == "self") for n in ast.walk(expr))


def _wrapper(fn, attrs):
    """(n, [condition node]) when method `fn` is `def w(self, a1..an, *args, **kwargs)` whose
    body is only `if C: return EXPR` statements (no else, each C _self_only) and then `return
    self.<attr>(*args, **kwargs)`: it reaches the kernel, passing its *args and **kwargs
    unchanged, exactly when every C is false. None when fn does not call self.<attr>(*args,
    **kwargs) at all; Refused (why) when it does in any other shape."""
    a = fn.args
    star, kw = (a.vararg.arg if a.vararg else None), (a.kwarg.arg if a.kwarg else None)

    def passes(call):
        return isinstance(call, ast.Call) and _self_attr(call.func) in attrs and len(call.args) == 1 \
            and isinstance(call.args[0], ast.Starred) and isinstance(call.args[0].value, ast.Name) \
            and call.args[0].value.id == star and len(call.keywords) == 1 and call.keywords[0].arg is None \
            and isinstance(call.keywords[0].value, ast.Name) and call.keywords[0].value.id == kw

    if not star or not kw or not any(passes(c) for c, _, _ in _calls_in(fn)):
        return None
    why = "%s:%d: %s.%s hands *%s, **%s to the kernel, but not as `if C: return X` branches on self's state " \
          "followed by `return self.<kernel>(*%s, **%s)`" % (BACKEND, fn.lineno, CLASS, fn.name, star, kw, star, kw)
    body = fn.body[1:] if fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(
        getattr(fn.body[0], "value", None), ast.Constant) else fn.body
    if a.kwonlyargs or a.defaults or not body or not (isinstance(body[-1], ast.Return) and passes(body[-1].value)):
        raise Refused(why)
    unless = []
    for stmt in body[:-1]:
        if not (isinstance(stmt, ast.If) and not stmt.orelse and len(stmt.body) == 1
                and isinstance(stmt.body[0], ast.Return) and _self_only(stmt.test)):
            raise Refused(why)
        unless.append(stmt.test)
    n = len(getattr(a, "posonlyargs", [])) + len(a.args) - 1
    return n, unless


def _wrappers(src, cls, attrs):
    """{method name: (its number of leading parameters after self, [the source of each
    condition under which it does not reach the kernel]), or the Refused saying why its shape is
    not one the guard can stand in front of} of the methods of `cls` that hand *args, **kwargs
    to the kernel (_wrapper)."""
    out = {}
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef):
            try:
                w = _wrapper(fn, attrs)
            except Refused as e:
                out[fn.name] = e
                continue
            if w is not None:
                out[fn.name] = (w[0], [src.segment(t) for t in w[1]])
    return out


def signature(location, module, local, seen=None):
    """{"file", "line", "params" (positional, in order), "kwonly", "varkw"} of top-level `def
    extend_attention_fwd` in `module` (as the install lays it out under `location`). `seen`: a
    dict given each path looked at: the sha256 (hex) of the bytes read, or None for a path that
    is not a file (what a remembered anchor is checked against: _still)."""
    seen = {} if seen is None else seen
    base = os.path.join(location, *module.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            break
        seen[path] = None
    else:
        raise Refused("%s imports %s from %s, which is not a file of this install" % (BACKEND, KERNEL_NAME, module))
    rel = os.path.relpath(path, location).replace(os.sep, "/")
    data, _ = callsites.read_source(path)
    seen[path] = hashlib.sha256(data).hexdigest()
    tree = ast.parse(callsites._decode(data), filename=rel)
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == KERNEL_NAME]
    if len(defs) != 1:
        raise Refused("%s defines %s %d times at its top level, not once" % (rel, KERNEL_NAME, len(defs)))
    a = defs[0].args
    return {"file": rel, "line": defs[0].lineno,
            "params": [p.arg for p in list(getattr(a, "posonlyargs", [])) + list(a.args)],
            "kwonly": [p.arg for p in a.kwonlyargs], "varkw": a.kwarg is not None}


def _named(src, call, drop, sig):
    """[[parameter name, argument source]] of the anchor `call`, its first `drop` arguments (a
    wrapper's own) left out; Refused for *x / **x, too many positional arguments, a keyword
    extend_attention_fwd does not take, or a parameter given twice."""
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        raise Refused("%s:%d: the extend call passes *args or **kwargs: its arguments cannot be named"
                      % (src.rel, call.lineno))
    args = call.args[drop:]
    if len(args) > len(sig["params"]):
        raise Refused("%s:%d: the extend call passes %d positional arguments; %s takes %d" % (
            src.rel, call.lineno, len(args), KERNEL_NAME, len(sig["params"])))
    named = [[p, src.segment(a)] for p, a in zip(sig["params"], args)]
    takes = set(sig["params"]) | set(sig["kwonly"])
    for k in call.keywords:
        if k.arg not in takes and not sig["varkw"]:
            raise Refused("%s:%d: the extend call passes %s=, which %s (%s:%d) does not take" % (
                src.rel, call.lineno, k.arg, KERNEL_NAME, sig["file"], sig["line"]))
        named.append([k.arg, src.segment(k.value)])
    names = [n for n, _ in named]
    twice = sorted(set(n for n in names if names.count(n) > 1))
    if twice:
        raise Refused("%s:%d: the extend call gives %s twice" % (src.rel, call.lineno, ", ".join(twice)))
    return named


def _present(src, stmt, test):
    """The text of the lines of `stmt` when `test(stmt)` says it is ours, else None."""
    return _lines(src, stmt.lineno, stmt.end_lineno) if stmt is not None and test(stmt) else None


def _is_guard(stmt):
    return isinstance(stmt, ast.If) and any(isinstance(n, ast.Name) and n.id == HOOK_NAME for n in ast.walk(stmt.test))


def _is_import(stmt):
    """`try: from ... import verify_fwd as _fleetctl_verify_fwd` / `except ...` (import.py.j2's)."""
    return isinstance(stmt, ast.Try) and any(isinstance(n, ast.ImportFrom) and any(
        a.asname == HOOK_NAME for a in n.names) for n in stmt.body)


def anchor(location, text, seen=None):
    """The anchor, its signature and the insertion sites in triton_backend.py's `text` (see the
    module docstring): {"anchor", "signature", "guard", "import", "forward_batch"}; `seen`, as
    signature() says, gets the other files the answer was read from. Raises Refused saying why
    the guard cannot go in exactly once, SyntaxError when it does not parse, ValueError when
    the signature's file is not UTF-8, OSError when it cannot be read."""
    src = _parse(BACKEND, text)
    classes = [n for n in src.tree.body if isinstance(n, ast.ClassDef) and n.name == CLASS]
    if len(classes) != 1:
        raise Refused("%s defines %s %d times at its top level, not once" % (BACKEND, CLASS, len(classes)))
    cls = classes[0]
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == METHOD]
    if len(methods) != 1:
        raise Refused("%s.%s is defined %d times, not once" % (CLASS, METHOD, len(methods)))
    fn = methods[0]
    module, local = _kernel_binding(src.tree)
    attrs = _kernel_attrs(src, cls, local)
    if not attrs:
        raise Refused("%s binds no self attribute to %s" % (CLASS, KERNEL_NAME))
    wrappers = _wrappers(src, cls, attrs)
    calls = [(c, s, b) for c, s, b in _calls_in(fn) if _self_attr(c.func) in attrs or _self_attr(c.func) in wrappers]
    if len(calls) != 1:
        raise Refused("%s.%s reaches %s %d times (%s), not once: the guard goes before exactly one call" % (
            CLASS, METHOD, KERNEL_NAME, len(calls),
            ", ".join("line %d" % c.lineno for c, _, _ in calls) or "no call of self.%s" % "/".join(sorted(attrs))))
    call, stmt, block = calls[0]
    if isinstance(wrappers.get(_self_attr(call.func)), Refused):
        raise wrappers[_self_attr(call.func)]
    if not isinstance(stmt, ast.Expr) or stmt.value is not call:
        raise Refused("%s:%d: the extend call is not a statement of its own" % (BACKEND, call.lineno))
    indent = _own_line(src, stmt)
    at = block.index(stmt)
    after = block[at + 1] if at + 1 < len(block) else None
    if not isinstance(after, ast.Return) or after.value is None:
        raise Refused("%s:%d: the extend call is not followed by `return EXPR`: the guard would not know what "
                      "%s returns" % (BACKEND, call.lineno, METHOD))
    params = [p.arg for p in fn.args.args]
    if "forward_batch" not in params:
        raise Refused("%s.%s takes no forward_batch (its parameters: %s)" % (CLASS, METHOD, ", ".join(params)))
    sig = signature(location, module, local, seen)
    attr = _self_attr(call.func)
    drop, unless = (0, []) if attr in attrs else wrappers[attr]
    before = block[at - 1] if at > 0 else None
    guard = _present(src, before, _is_guard)
    first = cls.decorator_list[0].lineno if cls.decorator_list else cls.lineno
    body = src.tree.body
    prev = body[body.index(cls) - 1] if body.index(cls) > 0 else None
    imported = _present(src, prev, _is_import)
    named = _named(src, call, drop, sig)
    missing = [n for n in buildtrust.NEEDED if n not in [name for name, _ in named]]
    if missing:
        raise Refused("%s:%d: the extend call does not pass %s under the names the hook needs (%s, %s:%d, names "
                      "its parameters %s)" % (BACKEND, call.lineno, ", ".join(missing), KERNEL_NAME, sig["file"],
                                              sig["line"], ", ".join(sig["params"] + sig["kwonly"])))
    return {
        "anchor": {"file": BACKEND, "line": call.lineno, "callee": "self." + attr, "dropped": drop,
                   "unless": unless, "arguments": named, "returns": src.segment(after.value)},
        "signature": sig, "forward_batch": "forward_batch",
        "guard": {"file": BACKEND, "line": before.lineno if guard is not None else stmt.lineno, "indent": indent,
                  "present": guard},
        "import": {"file": BACKEND, "line": prev.lineno if imported is not None else first, "indent": "",
                   "present": imported},
    }


def kernel(public_dir, torch_version, torch_unknown=None):
    """The published verify_attention build as this install's hook would load it: {"active":
    bool, "reason" (why not, or None), "link" (PUBLIC/verify_attention/current), "current" (its
    target), "build_dir", "module_path", "backend" ("cpu" | "cuda" | "triton", from the module's
    name), "torch_dir" (build.ninja's), "archs" (sm numbers the build's record names),
    "dispatch" (PUBLIC/verify_attention/dispatch.json as read, or None), "table" (what it routes:
    {"source", "all", "entries" (how many), "build" (the key it is for), "build_match" (that
    key is current's), "shapes" (["HEAD_DIM:GROUP:DRAFT_TOKENS:DTYPE[:MAX_BATCH]"] the hook
    routes), "routes" (anything at all), "why_not" (why nothing routes, or None), "why" (the
    table's own line)}, or None without a build)}.
    "active" needs the hook's trust walk (buildtrust.walk) to pass, as this probe's user (root:
    the hook's rule is about owners and modes, not who reads), and the build's torch to be `torch_version`
    (the install's, from facts; which torch install that is, the hook checks in the server's own
    process); when that version is None, the refusal says why (`torch_unknown`: facts torch's
    "reason", naming the dist-info to remove) rather than comparing it. A table that routes
    nothing leaves "active" true: the route gate fails it."""
    pkg = os.path.join(public_dir, PACKAGE)
    link = os.path.join(pkg, "current")
    out = {"active": False, "reason": None, "link": link, "current": None, "build_dir": None, "module_path": None,
           "backend": None, "torch_dir": None, "archs": [], "dispatch": None, "table": None}
    first = "run `fleetctl deploy kernel %s HOST` first" % PACKAGE
    if not os.path.lexists(link):
        out["reason"] = "%s is not deployed here (no %s): %s" % (PACKAGE, link, first)
        return out
    try:
        out["current"] = os.readlink(link)
    except OSError:
        pass
    try:
        key, bdir, module, table = buildtrust.walk(link)
    except (buildtrust.Untrusted, OSError) as e:
        out["reason"] = "the published build is not one the hook would load: %s: run `fleetctl deploy kernel %s " \
            "HOST` again" % (e if isinstance(e, buildtrust.Untrusted) else "%s: %s" % (type(e).__name__, e), PACKAGE)
        return out
    out.update(build_dir=bdir, module_path=module)
    name = os.path.basename(module).split(".")[0]
    out["backend"] = name[len(PACKAGE) + 1:] if name.startswith(PACKAGE + "_") else None
    out["dispatch"], out["table"] = _summary(table, key)
    built, where = _record(os.path.join(bdir, "build"), out)
    if torch_version is None:
        out["reason"] = ("this install's torch version cannot be known, so the active build %s (torch %s) cannot be "
                         "checked against it: %s" % (out["current"], built, torch_unknown or "torch is not importable "
                                                     "by this install's interpreter"))
        return out
    if built != torch_version:
        out["reason"] = ("the active build %s was made with torch %s (%s), and this install runs torch %s: %s (with "
                         "this install's interpreter)" % (out["current"], built, where, torch_version, first))
        return out
    out["active"] = True
    return out


def _summary(path, key):
    """(the dispatch table at `path` as read or None, kernel()'s "table" of it for build `key`)."""
    every, shapes, why_not = buildtrust.table(path, key)
    try:
        doc = json.loads(callsites.read_source(path)[0].decode("utf-8"))
    except (OSError, ValueError):
        doc = None
    d = doc if isinstance(doc, dict) else {}
    entries = d.get("entries")
    return doc, {"source": d.get("source"), "all": d.get("all") is True, "entries": len(entries) if isinstance(
        entries, list) else 0, "build": d.get("build"), "build_match": d.get("build") == key,
        "shapes": sorted("%d:%d:%d:%s" % s + ("" if m is None else ":%d" % m) for s, m in shapes.items()),
        "routes": why_not is None, "why_not": why_not, "why": d.get("why")}


def _record(build, out):
    """(torch version the build was made with, where that is read) from the build's own record:
    kernels/manifest.json (the triton build: its "torch" and "arch") or build.ninja
    (torch.utils.cpp_extension's: the torch headers it compiled against, whose version.py says
    which torch that is, and the -gencode archs); sets out["torch_dir"] and out["archs"]."""
    manifest = os.path.join(build, "kernels", "manifest.json")
    if os.path.isfile(manifest):
        try:
            made = json.loads(callsites.read_source(manifest)[0].decode("utf-8"))
            out["archs"] = [int(made["arch"])]
            return made.get("torch"), manifest
        except (OSError, ValueError, KeyError, TypeError):
            return None, manifest + " (unreadable)"
    try:
        ninja = callsites.read_source(os.path.join(build, "build.ninja"))[0].decode("utf-8", "replace")
    except OSError:
        return None, "no %s/build.ninja" % build
    m = _TORCH_INCLUDE.search(ninja)
    out["archs"] = sorted(set(int(a) for a in _ARCH.findall(ninja)))
    if not m:
        return None, "%s/build.ninja names no torch" % build
    out["torch_dir"] = m.group(1)
    return _torch_version(m.group(1)), "compiled against %s" % m.group(1)


def _torch_version(torch_dir):
    path = os.path.join(torch_dir, "version.py")
    try:
        text = callsites._decode(callsites.read_source(path)[0])
        tree = ast.parse(text)
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets) \
                and isinstance(node.value, ast.Constant):
            return node.value.value
    return None


def server(s):
    """{"pid", "uid" (real uid from /proc/PID/status, None when unreadable), "attention_backend"
    (what the command line names for target verify: --attention-backend, else --decode- and
    --prefill-attention-backend when both name the same one; None when unset)} of server `s`."""
    uid = None
    try:
        with open("/proc/%d/status" % s["pid"]) as f:
            for line in f:
                if line.startswith("Uid:"):
                    uid = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    argv = s.get("argv") or []
    backend = topology.option(argv, "--attention-backend")
    split = (topology.option(argv, "--prefill-attention-backend"), topology.option(argv, "--decode-attention-backend"))
    if any(split):
        backend = split[0] if split[0] == split[1] else "%s (prefill) / %s (decode)" % split
    return {"pid": s["pid"], "uid": uid, "attention_backend": backend}


def _still(seen):
    """Whether every path of `seen` (signature()'s record) is as it was: the same bytes (sha256),
    or still not a file."""
    if not isinstance(seen, dict):
        return False
    for path, sha in seen.items():
        if sha is None:
            if os.path.isfile(path):
                return False
            continue
        try:
            data, _ = callsites.read_source(path)
        except OSError:
            return False
        if hashlib.sha256(data).hexdigest() != sha:
            return False
    return True


def found_anchor(location, text, sha, store=None, install=None):
    """anchor()'s finding for triton_backend.py's `text` (sha256 `sha`, hex) under `location`:
    its dict, or {"refused": why}. With `store` (a scancache.Store) and `install` (the install's
    dict: its "id" and sglang "package_dir"), the finding is remembered in the install's "route"
    cache file with the files signature() read, and used again while `sha`, `location` and each
    of those files (its sha256, or its not being a file) are the same: the parse and the walk
    of the backend were most of a warm probe (0.5.23: 60 of 150 ms). A read that failed
    (OSError) is not remembered. Raises nothing for the install's code."""
    memo = store.load(install["id"], what="route")[0] if store is not None else {}
    if memo.get("backend_sha256") == sha and memo.get("location") == location and isinstance(
            memo.get("found"), dict) and _still(memo.get("seen")):
        return memo["found"]
    seen = {}
    try:
        found = anchor(location, text, seen)
    except Refused as e:
        found = {"refused": str(e)}
    except (SyntaxError, ValueError) as e:
        found = {"refused": "%s: %s: %s" % (BACKEND, type(e).__name__, e)}
    except OSError as e:
        return {"refused": "%s: %s: %s" % (BACKEND, type(e).__name__, e)}
    if store is not None:
        try:
            store.save(install["id"], install["sglang"]["package_dir"],
                       {"backend_sha256": sha, "location": location, "seen": seen, "found": found}, what="route")
        except OSError:
            pass  # an optimisation: the next probe reads the code again
    return found


def route(inst, servers, public_dir, with_sources, store=None):
    """The `verify_attention_route` finding of install `inst` (see the module docstring);
    `servers`: the host's servers (procs.find_servers), those of `inst` are judged; `public_dir`:
    where builds are published (PUBLIC_DIR); `store`: the scan cache the anchor is remembered in
    (found_anchor; None: read every time). Never raises for the install's code: a refusal is
    the finding's "refused"."""
    location = inst["sglang"]["location"]
    out = {"file": BACKEND, "hook_file": HOOK, "anchor": None, "refused": None, "signature": None, "guard": None,
           "import": None, "forward_batch": None, "files": {},
           "kernel": kernel(public_dir, (inst.get("torch") or {}).get("version"), (inst.get("torch") or {}).get("reason")),
           "servers": [server(s) for s in servers if s.get("install") == inst["id"]]}
    texts = {}
    for rel in (BACKEND, HOOK):
        try:
            data, _ = callsites.read_source(os.path.join(location, rel))
        except OSError:
            continue
        out["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        try:
            texts[rel] = data.decode("utf-8")
        except UnicodeDecodeError:
            texts[rel] = None
    if texts.get(BACKEND) is None:
        out["refused"] = "%s is %s" % (BACKEND, "not UTF-8 text" if BACKEND in texts else
                                       "not in this install: no Triton attention backend to route")
    else:
        out.update(found_anchor(location, texts[BACKEND], out["files"][BACKEND]["sha256"], store, inst))
    if with_sources:
        out["sources"] = texts
    return out
