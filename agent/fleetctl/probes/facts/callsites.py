"""Remote probe: exact AST introspection of KV pool allocator calls and need_sort origins.

Stdlib only, Python 3.8+, never prints. Run by the host's own interpreter (source sent on
stdin) or imported locally. Facts come from the installed SGLang sources themselves:
every ``*.py`` under ``<location>/sglang`` except ``test``/``tests`` folders.

Only files whose bytes contain ``TokenToKVPoolAllocator`` or ``need_sort`` are parsed
(every alias tracked below is bound from such a name, so that filter is complete); a file
outside that set is parsed later only if it defines a base class needed to resolve an
allocator's ``__init__`` signature.
"""

import ast
import errno
import hashlib
import io
import os
import re
import stat
import time
import tokenize
import warnings

from . import grepfilter

SUFFIX = "TokenToKVPoolAllocator"
_NEEDLES = (SUFFIX.encode(), b"need_sort")
_SKIP_DIRS = {"test", "tests", "__pycache__"}
_CLASS_RE = re.compile(rb"^[ \t]*class[ \t]+(\w+)", re.M)
_LINE_RE = re.compile(r"\r\n|\r|\n")
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_BINDERS = (ast.Assign, ast.AnnAssign, ast.NamedExpr, ast.Import, ast.ImportFrom)
_KEPT = _BINDERS + (ast.AugAssign, ast.Call, ast.ClassDef)
# Nodes with no kept node below them: names, constants, expression contexts and operators.
_LEAVES = frozenset([ast.Name, ast.Constant, ast.Load, ast.Store, ast.Del, ast.alias]
                    + [c for base in (ast.operator, ast.unaryop, ast.cmpop, ast.boolop)
                       for c in base.__subclasses__()])


def _last_name(node):
    """Name.id or Attribute.attr of `node`, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


class _Source(object):
    """One parsed file: relative path, text, tree, its nodes (see _walk), char offsets."""

    def __init__(self, rel, text, tree):
        self.rel, self.text, self.tree = rel, text, tree
        self.nodes = _walk(tree)
        self.line_starts = [0] + [m.end() for m in _LINE_RE.finditer(text)]

    def char_col(self, lineno, byte_col):
        """ast's UTF-8 byte column on 1-based `lineno` -> character column in that line."""
        start = self.line_starts[lineno - 1]
        end = self.line_starts[lineno] if lineno < len(self.line_starts) else len(self.text)
        return len(self.text[start:end].encode("utf-8")[:byte_col].decode("utf-8", "replace"))

    def segment(self, node):
        """Source text of `node` (what ast.get_source_segment gives, without re-splitting)."""
        start = self.line_starts[node.lineno - 1] + self.char_col(node.lineno, node.col_offset)
        end = self.line_starts[node.end_lineno - 1] + self.char_col(node.end_lineno, node.end_col_offset)
        return self.text[start:end]

    def span(self, node):
        return {"value_line": node.lineno, "value_col": self.char_col(node.lineno, node.col_offset),
                "value_end_line": node.end_lineno,
                "value_end_col": self.char_col(node.end_lineno, node.end_col_offset)}


def _decode(data):
    """Source bytes -> str, honouring a PEP 263 coding line and a BOM."""
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return data.decode(encoding)


def _walk(tree):
    """[(node, enclosing statement, scope chain)] for every call, binding and class below `tree`.

    The scope chain is a tuple of the enclosing function/lambda/class nodes, innermost last.
    """
    out = []
    stack = [(tree, None, ())]
    AST, stmt_type, leaves, kept = ast.AST, ast.stmt, _LEAVES, _KEPT
    while stack:
        node, stmt, scopes = stack.pop()
        inner = scopes + (node,) if isinstance(node, _SCOPES) else scopes
        for field in node._fields:  # ast.iter_child_nodes' order, without its generators (a third of a parse)
            value = getattr(node, field, None)
            for child in (value if type(value) is list else (value,)):
                if not isinstance(child, AST) or type(child) in leaves:  # leaves: nothing below them is kept (~40%)
                    continue
                item = (child, child if isinstance(child, stmt_type) else stmt, inner)
                stack.append(item)
                if isinstance(child, kept):
                    out.append(item)
    return out


def _alias_targets(value, aliases, scopes):
    """Allocator class names `value` may evaluate to (Name/Attribute, IfExp, BoolOp, alias)."""
    if isinstance(value, ast.IfExp):
        return _alias_targets(value.body, aliases, scopes) + _alias_targets(value.orelse, aliases, scopes)
    if isinstance(value, ast.BoolOp):
        return [n for v in value.values for n in _alias_targets(v, aliases, scopes)]
    name = _last_name(value)
    if name is None:
        return []
    if name.endswith(SUFFIX):
        return [name]
    if isinstance(value, ast.Name):
        return _lookup(aliases, scopes, name) or []
    return []


def _lookup(aliases, scopes, name):
    """alias_of list of `name` seen from `scopes` (innermost first, then module), or None.

    Enclosing class bodies are skipped, as Python's name resolution does."""
    for i in range(len(scopes), -1, -1):
        if i and i < len(scopes) and isinstance(scopes[i - 1], ast.ClassDef):
            continue
        key = (id(scopes[i - 1]) if i else None, name)
        if key in aliases:
            return aliases[key]
    return None


def _collect_aliases(nodes):
    """Local names bound to allocator classes: {(scope id, name): [class names]}."""
    aliases = {}
    binders = [n for n in nodes if isinstance(n[0], _BINDERS)]
    changed = True
    while changed:  # fixpoint, so that alias-of-alias chains resolve in any order
        changed = False
        for node, _, scopes in binders:
            pairs = []
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found = _alias_targets(node.value, aliases, scopes)
                pairs = [(t.id, found) for t in targets if isinstance(t, ast.Name) and found]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                pairs = [(a.asname, [a.name.rsplit(".", 1)[-1]]) for a in node.names
                         if a.asname and a.name.endswith(SUFFIX) and not a.asname.endswith(SUFFIX)]
            for name, found in pairs:
                key = (id(scopes[-1]) if scopes else None, name)
                merged = aliases.get(key, [])
                new = [n for n in found if n not in merged]
                if new:
                    aliases[key] = merged + new
                    changed = True
    return aliases


def _init_signature(fn):
    """need_sort facts of an `__init__` def: (has_param, positional index or None, has_default)."""
    a = fn.args
    positional = (getattr(a, "posonlyargs", []) + a.args)[1:]  # drop self
    for i, arg in enumerate(positional):
        if arg.arg == "need_sort":
            return True, i, i >= len(positional) - len(a.defaults)
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        if arg.arg == "need_sort":
            return True, None, default is not None
    return False, None, False


def _class_facts(src):
    """[[name, __init__ facts (see _init_signature) or None, [base last names, None for other
    expressions]]] of every class in `src` (nested ones too), in _walk order."""
    out = []
    for node, _, _ in src.nodes:
        if isinstance(node, ast.ClassDef):
            init = next((list(_init_signature(s)) for s in node.body
                         if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == "__init__"), None)
            out.append([node.name, init, [_last_name(b) for b in node.bases]])
    return out


def _import_facts(src):
    """{name: [files relative to the location it may come from]} for every `from X import name` in `src`."""
    pkg = src.rel.split("/")[:-1]
    out = {}
    for node, _, _ in src.nodes:
        if isinstance(node, ast.ImportFrom):
            parts = (pkg[:len(pkg) - node.level + 1] if node.level else []) + (node.module or "").split(".")
            base = "/".join(p for p in parts if p)
            for a in node.names:
                out.setdefault(a.name, []).extend([base + ".py", base + "/__init__.py"])
    return out


class _Resolver(object):
    """The cross-file facts, redone every scan from the per-file summaries: which class a name
    means seen from a file, and which `__init__` it runs. `parsed`: {rel: summary["parsed"]};
    `class_files`: {class name: [rel]} of files not parsed (a `class <name>` line); `load(rel)`:
    the summary of such a file, parsed on demand (None when it cannot be)."""

    def __init__(self, parsed, class_files, load):
        self.parsed, self.class_files, self.load = parsed, class_files, load
        self.classes = {}  # class name -> [(rel, index in that file's classes)]
        self._params = {}  # (class name, from rel, skip) -> need_sort_param result
        for rel in sorted(parsed):
            self._index(rel)

    def _index(self, rel):
        for i, c in enumerate(self.parsed[rel]["classes"]):
            self.classes.setdefault(c[0], []).append((rel, i))

    def find_class(self, name, from_rel, skip=None):
        """(rel, index) of the class named `name` other than `skip`: in `from_rel` first, then
        the module `from_rel` imports it from, then the first by path; None when none."""
        if name not in self.classes:
            for rel in self.class_files.pop(name, []):
                if rel not in self.parsed:
                    found = self.load(rel)
                    if found is not None:
                        self.parsed[rel] = found
                        self._index(rel)
        imports = self.parsed[from_rel]["imports"] if from_rel in self.parsed else {}
        preferred = [from_rel] + imports.get(name, [])

        def rank(d):
            return (preferred.index(d[0]) if d[0] in preferred else len(preferred), d[0])
        defs = sorted((d for d in self.classes.get(name, []) if d != skip), key=rank)
        return defs[0] if defs else None

    def need_sort_param(self, name, from_rel, skip=None, depth=0):
        """(has_param, index, has_default, "rel::Class") of the `__init__` that class `name`
        (seen from file `from_rel`) runs, following bases left to right when it has none of
        its own (`class X(mod.X)` resolves to the other X); None if unresolved."""
        key = (name, from_rel, skip)
        if key not in self._params:
            self._params[key] = self._need_sort_param(name, from_rel, skip, depth)
        return self._params[key]

    def _need_sort_param(self, name, from_rel, skip, depth):
        found = self.find_class(name, from_rel, skip)
        if found is None or depth > 32:  # depth: a guard against inheritance cycles
            return None
        rel, i = found
        _, init, bases = self.parsed[rel]["classes"][i]
        if init is not None:
            return tuple(init) + ("%s::%s" % (rel, name),)
        for base_name in bases:
            res = base_name and self.need_sort_param(base_name, rel, found if base_name == name else None, depth + 1)
            if res:
                return res
        return None


def _raw_site(src, call, callee, alias_of):
    """One allocator call site as file `src` alone determines it (see scan); a call without a
    need_sort keyword keeps, under "_args", what _resolve_site needs: the classes it may
    construct, its positional argument texts (up to a *arg) and whether * or ** is passed."""
    site = {"file": src.rel, "line": call.lineno, "end_line": call.end_lineno,
            "col": src.char_col(call.lineno, call.col_offset),
            "end_col": src.char_col(call.end_lineno, call.end_col_offset),
            "callee": callee, "aliased": bool(alias_of), "need_sort": {"passing": "absent", "expr": None}}
    if alias_of:
        site["alias_of"] = alias_of
    kw = [k for k in call.keywords if k.arg == "need_sort"]
    if kw:
        site["need_sort"] = {"passing": "keyword", "expr": src.segment(kw[0].value)}
        return site
    positional, starargs = [], False
    for arg in call.args:
        if isinstance(arg, ast.Starred):
            starargs = True
            break
        positional.append(src.segment(arg))
    site["_args"] = {"classes": alias_of or [callee], "positional": positional, "starargs": starargs,
                     "kwargs": any(k.arg is None for k in call.keywords)}
    return site


def _resolve_site(resolver, raw):
    """The call site `raw` (see _raw_site) with how need_sort reaches the `__init__` it runs."""
    site = dict(raw)
    args = site.pop("_args", None)
    if args is None:
        return site
    ns = site["need_sort"] = dict(site["need_sort"])
    param = None
    for cls in args["classes"]:
        param = resolver.need_sort_param(cls, site["file"])
        if param:
            break
    ns["resolved"] = param[3] if param else None
    if args["starargs"]:
        ns["starargs"] = True
    if param and param[1] is not None and param[1] < len(args["positional"]):
        ns.update(passing="positional", expr=args["positional"][param[1]])
    elif param and param[0] and param[2]:
        ns["passing"] = "default"
    if args["kwargs"]:
        ns["kwargs"] = True
    return site


def _origin(src, kind, line, value, stmt, callee=None, target=None):
    """One need_sort origin dict (see scan)."""
    o = {"file": src.rel, "line": line, "col": src.char_col(value.lineno, value.col_offset),
         "kind": kind, "callee": callee, "expr": src.segment(value),
         "literal": isinstance(value, ast.Constant), "stmt_end_line": stmt.end_lineno}
    if target is not None:
        o["target"] = target
    o.update(src.span(value))
    return o


def _scan_source(src):
    """(raw call sites (see _raw_site), origins) found in one parsed source."""
    aliases = _collect_aliases(src.nodes)
    sites, origins = [], []
    for node, stmt, scopes in src.nodes:
        if isinstance(node, ast.Call):
            callee = _last_name(node.func)
            if callee and callee.endswith(SUFFIX):
                sites.append(_raw_site(src, node, callee, None))
            elif isinstance(node.func, ast.Name) and _lookup(aliases, scopes, callee):
                sites.append(_raw_site(src, node, callee, _lookup(aliases, scopes, callee)))
            for k in node.keywords:
                if k.arg == "need_sort" and not isinstance(k.value, ast.Name):
                    origins.append(_origin(src, "keyword", k.value.lineno, k.value, stmt,
                                           callee=_last_name(node.func)))
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
            if node.value is None:
                continue  # bare annotation `need_sort: bool`
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:  # the local `need_sort`; `self.need_sort = ...` only stores it
                if isinstance(t, ast.Name) and t.id == "need_sort":
                    origins.append(_origin(src, "assignment", node.lineno, node.value, stmt,
                                           target=src.segment(t)))
    return sites, origins


def summarize(rel, data):
    """What file `rel` (its bytes `data`) alone determines: {"parsed": {classes (_class_facts),
    imports (_import_facts), sites (raw, _raw_site), origins}} or {"error": "<Type>: <message>"}
    when it does not decode or parse."""
    try:
        text = _decode(data)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. invalid escapes: not ours to report
            src = _Source(rel, text, ast.parse(text, filename=rel))
    except (SyntaxError, ValueError, LookupError, RecursionError) as e:
        return {"error": "%s: %s" % (type(e).__name__, e)}
    sites, origins = _scan_source(src)
    return {"parsed": {"classes": _class_facts(src), "imports": _import_facts(src), "sites": sites,
                       "origins": origins}}


# A source file larger than this is not read (SGLang's largest is well under 1 MiB).
MAX_SOURCE_BYTES = 16 << 20
MAX_WORKERS = 8  # scan worker processes at most (issue 18)
POOL_MIN_JOBS = 8  # fewer files than this are parsed in this process (a fork costs more)
GREP_MIN_FILES = 64  # fewer files to read than this are read in Python (starting grep costs more)
RACY_S = 2.0  # a file changed this recently is not cached: a rewrite within its ctime tick would pass


def read_source(path):
    """(bytes, os.stat_result of the open file) of source file `path`, which must be a regular
    file (never followed through a symlink, never a FIFO or device: those would hang or leave the
    tree) of at most MAX_SOURCE_BYTES. Raises OSError saying why not (review L11)."""
    if not stat.S_ISREG(os.lstat(path).st_mode):  # not even opened: a device's open has effects
        raise OSError(errno.EINVAL, "not a regular file, not read", path)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file, not read", path)
        if st.st_size > MAX_SOURCE_BYTES:
            raise OSError(errno.EFBIG, "over %d bytes, not read" % MAX_SOURCE_BYTES, path)
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(MAX_SOURCE_BYTES + 1)[:MAX_SOURCE_BYTES], st
    finally:
        os.close(fd)


def identity(st):
    """A file's identity for the scan cache: [size, mtime_ns, ctime_ns, inode] (ctime and inode
    catch a rewrite whose size and mtime were put back)."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def file_entry(path, rel, parse):
    """One file's cache entry: {"id": identity, "candidate": holds a needle, "sha256" and "size"
    (candidates), "class_names" (others: `class <name>` lines), + summarize()'s keys when
    `parse`} or {"read_error": "<Type>: <message>"} when it cannot be read (see read_source).
    Runs in a scan worker."""
    try:
        data, st = read_source(path)
    except OSError as e:
        return {"read_error": "%s: %s" % (type(e).__name__, e)}
    entry = {"id": identity(st), "candidate": any(n in data for n in _NEEDLES)}
    if entry["candidate"]:
        entry.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    else:
        names = [n.decode("ascii", "replace") for n in _CLASS_RE.findall(data)]
        entry["class_names"] = sorted(set(names), key=names.index)
    if parse:
        entry.update(summarize(rel, data))
    return entry


def _entry_job(job):
    return file_entry(*job)


def _cgroup_cpus():
    """CPUs the cgroup CPU quota allows (cgroup v2 cpu.max, else v1 cfs quota), None when unlimited."""
    try:
        with open("/proc/self/cgroup") as f:
            own = [line.rstrip("\n").split(":", 2)[2] for line in f if line.startswith("0::")]
    except OSError:
        own = []
    paths = [("/sys/fs/cgroup%s/cpu.max" % p.rstrip("/"), None) for p in own] + [
        ("/sys/fs/cgroup/cpu.max", None), ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")]
    for quota_path, period_path in paths:
        try:
            with open(quota_path) as f:
                words = f.read().split()
            if period_path:
                with open(period_path) as f:
                    words.append(f.read().strip())
        except OSError:
            continue
        if len(words) == 2 and words[0].isdigit() and words[1].isdigit() and int(words[1]) > 0:
            return max(1, -(-int(words[0]) // int(words[1])))
        return None  # "max" or -1: no quota
    return None


def pool_size():
    """Scan workers: min(MAX_WORKERS, CPUs this process may run on, the cgroup CPU quota)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min([MAX_WORKERS, cpus] + [q for q in [_cgroup_cpus()] if q]))


class _Workers(object):
    """Maps file_entry over parse jobs: in a pool of forked workers at nice 10 (a serving host's own
    work comes first) when there are enough jobs and fork is available, else in this process."""

    def __init__(self, size):
        self.size, self.pool = size, None

    def map(self, jobs):
        """[file_entry(*job) for job in jobs], in that order."""
        if self.size > 1 and len(jobs) >= POOL_MIN_JOBS and self.pool is None:
            try:
                import multiprocessing  # only when there is work for a pool (a warm scan has none)
                ctx = multiprocessing.get_context("fork")
                self.pool = ctx.Pool(self.size, initializer=os.nice, initargs=(10,))
            except (ValueError, OSError):
                self.size = 1
        if self.pool is not None and len(jobs) >= POOL_MIN_JOBS:
            return self.pool.map(_entry_job, jobs, chunksize=max(1, len(jobs) // (self.size * 4)))
        return [file_entry(*j) for j in jobs]

    def close(self):
        if self.pool is not None:
            self.pool.close()
            self.pool.join()


def _tree(directory, reldir, paths, ids, parse_errors):
    """Add the `.py` files under `directory` (`reldir`: its path relative to the scan's location,
    ending in "/") to `paths` ([(path, rel)], each directory's files by name, then its
    subdirectories by name) and their identities (lstat, None when it failed) to `ids`; the
    _SKIP_DIRS directories are left out, a symlinked directory is never entered (said in
    `parse_errors`), an unreadable one is passed over (as os.walk does). One os.scandir per
    directory, its entries' own lstat: a third cheaper than os.walk plus a join and an lstat per
    file (0.5.23's 4,024 files: 21 against 31 ms), most of a warm scan. Returns (paths, ids)."""
    try:
        with os.scandir(directory) as it:
            found = sorted(it, key=lambda e: e.name)
    except OSError:
        return paths, ids
    below = []
    for e in found:
        try:
            is_dir = e.is_dir()
        except OSError:
            is_dir = False
        if is_dir:
            if e.name not in _SKIP_DIRS:
                below.append(e)
        elif e.name.endswith(".py"):
            paths.append((e.path, reldir + e.name))
            try:
                ids.append(identity(e.stat(follow_symlinks=False)))
            except OSError:
                ids.append(None)
    for e in below:
        try:
            link = e.is_symlink()
        except OSError:  # gone since the listing: as os.path.islink says, not a link (its scandir then fails)
            link = False
        if link:
            parse_errors.append({"file": reldir + e.name, "error": "skipped: a symlinked directory, not followed "
                                                                   "(none of its files is scanned)"})
        else:
            _tree(e.path, reldir + e.name + "/", paths, ids, parse_errors)
    return paths, ids


def scan(location, cache=None, workers=None, use_grep=True):
    """Scan the `sglang` package installed in site-packages directory `location`.

    Args: location, a directory path holding `sglang/` (e.g. ".../site-packages"); cache, the
    {rel: entry (file_entry)} of an earlier scan of the same install, or None: entries whose
    identity still matches the file are used instead of reading it, and `cache` is replaced in
    place by this scan's entries (vanished files dropped, files changed in the last RACY_S
    seconds left out: their ctime cannot yet tell a later rewrite); workers: the pool size
    (None: pool_size(); 1: this process only); use_grep: when at least GREP_MIN_FILES files
    must be read, let the host's own GNU grep find the candidates and class lines
    (grepfilter.prefilter: the same entries, faster), falling back to Python where it cannot.
    Returns a JSON-serialisable dict, every list sorted by (file, line, col), never truncated:
      allocator_call_sites: [{file (relative to location), line/end_line (ast.Call lineno/end_lineno),
        col/end_col (character offsets), callee (last name), aliased (bool), alias_of (aliased only),
        need_sort: {passing: keyword|positional|absent|default, expr: source text|None,
                    resolved: "rel::Class" whose __init__ decided it (non-keyword only),
                    kwargs/starargs: True when ** / * could also carry need_sort}}];
      need_sort_origins: [{file, line, col, kind: assignment|keyword, callee (keyword only),
        expr, literal (value is a Constant), target (assignment only), value_line, value_col,
        value_end_line, value_end_col (span of the value, character columns), stmt_end_line}];
      files: {rel: {sha256, size (bytes)}} for files holding a call site or origin;
      stats: {files_total, files_parsed}; parse_errors: [{file, error}] (also each file that is
        not a regular one and each symlinked directory: skipped, never read or followed);
      phases_s: {walk, prefilter (prefilter_grep when grep did it), parse, analysis} (wall seconds); cache: {hits, misses} (files),
        + changed (bool: whether `cache` now differs from what was passed) when a cache was passed.
    Only the cross-file resolution (base classes, `__init__` signatures) is redone for files
    found in `cache`; the answer is the same with or without it. `need_sort` parameter defaults
    in signatures and attribute stores (`self.need_sort = x`, which keep a value that came from
    an origin) are not origins. Raises nothing for bad files (they go to parse_errors); an
    unreadable `location` gives empty results.
    """
    old = cache if cache is not None else {}
    entries, parse_errors, phases = {}, [], {}
    t = time.time()
    top = os.path.join(location, "sglang")
    paths, ids = _tree(top, "sglang/", [], [], parse_errors)
    misses = []
    for (path, rel), now in zip(paths, ids):
        e = old.get(rel)
        if e is not None and now is not None and e.get("id") == now:
            entries[rel] = e
        else:
            misses.append((path, rel, False))
    phases["walk"] = time.time() - t
    pool = _Workers(pool_size() if workers is None else workers)
    try:
        t = time.time()
        grep = grepfilter.system_grep() if len(misses) >= GREP_MIN_FILES and use_grep else None
        found = grepfilter.prefilter(grep, top, misses, _NEEDLES, _SKIP_DIRS, MAX_SOURCE_BYTES) if grep else None
        for path, rel, _ in misses:  # reading and a substring test: a worker would cost more than it saves
            e = found.get(path) if found is not None else None
            entries[rel] = e if e is not None else file_entry(path, rel, False)
        phases["prefilter_grep" if found is not None else "prefilter"] = time.time() - t
        t = time.time()
        unparsed = [(p, rel, True) for p, rel in paths
                    if entries[rel].get("candidate") and "parsed" not in entries[rel] and "error" not in entries[rel]]
        for (path, rel, _), e in zip(unparsed, pool.map(unparsed)):
            entries[rel] = e
        phases["parse"] = time.time() - t
    finally:
        pool.close()
    t = time.time()
    for path, rel in paths:
        if "read_error" in entries[rel]:
            parse_errors.append({"file": rel, "error": entries.pop(rel)["read_error"]})
    parsed, class_files = {}, {}
    candidates = [rel for _, rel in paths if rel in entries and entries[rel]["candidate"]]
    for rel, e in entries.items():  # other files' classes are looked at only when needed (load)
        if e["candidate"] and "parsed" in e:
            parsed[rel] = e["parsed"]
        elif not e["candidate"]:
            for n in e["class_names"]:
                class_files.setdefault(n, []).append(rel)
    lazily = []

    def load(rel):
        """Parse non-candidate `rel` (once per cache lifetime) for the classes it defines."""
        e = entries[rel]
        if "parsed" not in e and "error" not in e:
            e = file_entry(os.path.join(location, rel), rel, True)
            if "read_error" in e:
                parse_errors.append({"file": rel, "error": e["read_error"]})
                return None
            entries[rel] = e
        lazily.append(rel)
        return e.get("parsed")

    resolver = _Resolver(parsed, class_files, load)
    sites, origins = [], []
    for rel in candidates:
        if "parsed" in entries[rel]:
            sites += [_resolve_site(resolver, s) for s in entries[rel]["parsed"]["sites"]]
            origins += entries[rel]["parsed"]["origins"]
    parse_errors += [{"file": rel, "error": entries[rel]["error"]} for rel in candidates + lazily
                     if "error" in entries[rel]]

    def key(d):
        return (d["file"], d["line"], d["col"])
    used = {d["file"] for d in sites + origins}
    result = {"allocator_call_sites": sorted(sites, key=key),
              "need_sort_origins": sorted(origins, key=key),
              "files": dict((rel, {"sha256": entries[rel]["sha256"], "size": entries[rel]["size"]})
                            for rel in sorted(used)),
              "stats": {"files_total": len(paths), "files_parsed": len(resolver.parsed)},
              "parse_errors": sorted(parse_errors, key=lambda e: e["file"]),
              "cache": {"hits": len(paths) - len(misses), "misses": len(misses)}}
    phases["analysis"] = time.time() - t
    result["phases_s"] = dict((k, round(v, 4)) for k, v in phases.items())
    if cache is not None:
        settled = time.time_ns() - int(RACY_S * 1e9)
        kept = dict((rel, e) for rel, e in entries.items() if e["id"][2] < settled)
        result["cache"]["changed"] = len(kept) != len(old) or any(old.get(rel) is not e for rel, e in kept.items())
        cache.clear()
        cache.update(kept)
    return result


def main(params):
    """Probe entry point: params {"location": site-packages dir} -> scan(location)."""
    return scan(params["location"])
