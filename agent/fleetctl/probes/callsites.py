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
import tokenize
import warnings

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
    while stack:
        node, stmt, scopes = stack.pop()
        inner = scopes + (node,) if isinstance(node, _SCOPES) else scopes
        for child in ast.iter_child_nodes(node):
            if type(child) in _LEAVES:  # nothing below them is kept (measured: ~40% of all nodes)
                continue
            item = (child, child if isinstance(child, ast.stmt) else stmt, inner)
            stack.append(item)
            if isinstance(child, _KEPT):
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


class _Tree(object):
    """The sglang tree: every file's path, the parsed sources, and their classes by name."""

    def __init__(self, location):
        self.location = location
        self.files = []        # every scanned rel path
        self.sources = {}      # rel -> _Source
        self.classes = {}      # class name -> [(rel, ClassDef)] of parsed sources
        self.parse_errors = []
        self._indexed = False  # whether unparsed files were searched for class definitions
        self._params = {}      # (class name, from rel) -> need_sort_param result

    def parse(self, rel, data):
        """Parse one file; a failure goes to parse_errors and returns None."""
        try:
            text = _decode(data)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # e.g. invalid escapes: not ours to report
                src = _Source(rel, text, ast.parse(text, filename=rel))
        except (SyntaxError, ValueError, LookupError, RecursionError) as e:
            self.parse_errors.append({"file": rel, "error": "%s: %s" % (type(e).__name__, e)})
            return None
        self.sources[rel] = src
        for node, _, _ in src.nodes:
            if isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, []).append((rel, node))
        return src

    def _parse_defining(self, name):
        """Parse every not-yet-parsed file with a `class <name>` line (first miss reads all)."""
        if not self._indexed:
            self._indexed, self._class_files = True, {}
            for rel in self.files:
                if rel in self.sources:
                    continue
                try:
                    found = _CLASS_RE.findall(read_source(os.path.join(self.location, rel)))
                except OSError:
                    continue
                for n in found:
                    self._class_files.setdefault(n.decode("ascii", "replace"), []).append(rel)
        for rel in self._class_files.pop(name, []):
            try:
                self.parse(rel, read_source(os.path.join(self.location, rel)))
            except OSError as e:
                self.parse_errors.append({"file": rel, "error": "%s: %s" % (type(e).__name__, e)})

    def find_class(self, name, from_rel, skip=None):
        """ClassDef named `name` other than `skip`: in `from_rel` first, then the module
        `from_rel` imports it from, then the first by path. Returns (rel, ClassDef) or None."""
        if name not in self.classes:
            self._parse_defining(name)
        preferred = [from_rel] + _import_origins(self.sources.get(from_rel), name)

        def rank(d):
            return (preferred.index(d[0]) if d[0] in preferred else len(preferred), d[0])
        defs = sorted((d for d in self.classes.get(name, []) if d[1] is not skip), key=rank)
        return defs[0] if defs else None

    def need_sort_param(self, name, from_rel, skip=None, depth=0):
        """(has_param, index, has_default, "rel::Class") of the `__init__` that class `name`
        (seen from file `from_rel`) runs, following bases left to right when it has none of
        its own (`class X(mod.X)` resolves to the other X); None if unresolved."""
        key = (name, from_rel, id(skip))
        if key not in self._params:
            self._params[key] = self._need_sort_param(name, from_rel, skip, depth)
        return self._params[key]

    def _need_sort_param(self, name, from_rel, skip, depth):
        found = self.find_class(name, from_rel, skip)
        if found is None or depth > 32:  # depth: a guard against inheritance cycles
            return None
        rel, cls = found
        for stmt in cls.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == "__init__":
                return _init_signature(stmt) + ("%s::%s" % (rel, name),)
        for base in cls.bases:
            base_name = _last_name(base)
            res = base_name and self.need_sort_param(base_name, rel, cls if base_name == name else None, depth + 1)
            if res:
                return res
        return None


def _import_origins(src, name):
    """Files (relative to the location) that `src` imports class `name` from."""
    if src is None:
        return []
    pkg = src.rel.split("/")[:-1]
    out = []
    for node, _, _ in src.nodes:
        if isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names):
            parts = (pkg[:len(pkg) - node.level + 1] if node.level else []) + (node.module or "").split(".")
            base = "/".join(p for p in parts if p)
            out += [base + ".py", base + "/__init__.py"]
    return out


def _call_site(tree, src, call, callee, alias_of):
    """One allocator call site dict (see scan)."""
    ns = {"passing": "absent", "expr": None}
    kw = [k for k in call.keywords if k.arg == "need_sort"]
    if kw:
        ns = {"passing": "keyword", "expr": src.segment(kw[0].value)}
    else:
        param = None
        for cls in alias_of or [callee]:
            param = tree.need_sort_param(cls, src.rel)
            if param:
                break
        ns["resolved"] = param[3] if param else None
        positional = []
        for arg in call.args:
            if isinstance(arg, ast.Starred):
                ns["starargs"] = True
                break
            positional.append(arg)
        if param and param[1] is not None and param[1] < len(positional):
            ns.update(passing="positional", expr=src.segment(positional[param[1]]))
        elif param and param[0] and param[2]:
            ns["passing"] = "default"
        if any(k.arg is None for k in call.keywords):
            ns["kwargs"] = True
    site = {"file": src.rel, "line": call.lineno, "end_line": call.end_lineno,
            "col": src.char_col(call.lineno, call.col_offset),
            "end_col": src.char_col(call.end_lineno, call.end_col_offset),
            "callee": callee, "aliased": bool(alias_of), "need_sort": ns}
    if alias_of:
        site["alias_of"] = alias_of
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


def _scan_source(tree, src):
    """(call sites, origins) found in one parsed source."""
    aliases = _collect_aliases(src.nodes)
    sites, origins = [], []
    for node, stmt, scopes in src.nodes:
        if isinstance(node, ast.Call):
            callee = _last_name(node.func)
            if callee and callee.endswith(SUFFIX):
                sites.append(_call_site(tree, src, node, callee, None))
            elif isinstance(node.func, ast.Name) and _lookup(aliases, scopes, callee):
                sites.append(_call_site(tree, src, node, callee, _lookup(aliases, scopes, callee)))
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


# A source file larger than this is not read (SGLang's largest is well under 1 MiB).
MAX_SOURCE_BYTES = 16 << 20


def read_source(path):
    """The bytes of source file `path`, which must be a regular file (never followed through a
    symlink, never a FIFO or device: those would hang or leave the tree) of at most
    MAX_SOURCE_BYTES. Raises OSError saying why not (review L11)."""
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
            return f.read(MAX_SOURCE_BYTES + 1)[:MAX_SOURCE_BYTES]
    finally:
        os.close(fd)


def scan(location):
    """Scan the `sglang` package installed in site-packages directory `location`.

    Args: location, a directory path holding `sglang/` (e.g. ".../site-packages").
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
        not a regular one and each symlinked directory: skipped, never read or followed).
    `need_sort` parameter defaults in signatures and attribute stores (`self.need_sort = x`,
    which keep a value that came from an origin) are not origins. Raises nothing for bad
    files (they go to parse_errors); an unreadable `location` gives empty results.
    """
    tree = _Tree(location)
    root = os.path.join(location, "sglang")
    hashes, candidates = {}, []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for d in dirnames:  # os.walk lists a symlinked directory but never enters it: say so
            if os.path.islink(os.path.join(dirpath, d)):
                rel = os.path.relpath(os.path.join(dirpath, d), location).replace(os.sep, "/")
                tree.parse_errors.append({"file": rel, "error": "skipped: a symlinked directory, not followed "
                                                                "(none of its files is scanned)"})
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            path = os.path.join(dirpath, fn)
            rel = os.path.relpath(path, location).replace(os.sep, "/")
            tree.files.append(rel)
            try:
                data = read_source(path)
            except OSError as e:
                tree.parse_errors.append({"file": rel, "error": "%s: %s" % (type(e).__name__, e)})
                continue
            if any(n in data for n in _NEEDLES):
                hashes[rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
                candidates.append((rel, data))
    for rel, data in candidates:
        tree.parse(rel, data)
    sites, origins = [], []
    for rel, _ in candidates:
        if rel in tree.sources:
            s, o = _scan_source(tree, tree.sources[rel])
            sites += s
            origins += o

    def key(d):
        return (d["file"], d["line"], d["col"])
    used = {d["file"] for d in sites + origins}
    return {"allocator_call_sites": sorted(sites, key=key),
            "need_sort_origins": sorted(origins, key=key),
            "files": {rel: hashes[rel] for rel in sorted(used)},
            "stats": {"files_total": len(tree.files), "files_parsed": len(tree.sources)},
            "parse_errors": sorted(tree.parse_errors, key=lambda e: e["file"])}


def main(params):
    """Probe entry point: params {"location": site-packages dir} -> scan(location)."""
    return scan(params["location"])
