"""Kernel packages: `kernels/NAME/kernel.yaml` plus its sources, validated, hashed into build keys.

kernel.yaml fields (all required except the flag lists):
    name: NAME                      # must equal the directory name; a Python identifier
    version: "0.1.0"                # a string
    backends:                       # at least one of cpu, cuda, triton
      cpu:  {sources: [a.cpp], cflags: [...], ldflags: [...]}
      cuda: {sources: [b.cpp, c.cu], cflags: [...], cuda_cflags: [...], ldflags: [...]}
      triton: {module: m.py, build: build, load: load}
                                    # m.py's build(arch: int, out_dir) -> manifest compiles every
                                    # instantiation ahead of time for sm_<arch>; load(out_dir)
                                    # returns the kernels (verify_attention, ...) without compiling
    reference: reference.py:FUNC    # float64 ground truth
    test: test_kernel.py            # run on the host against the built module
    tolerances: {float32: {atol: X, rtol: Y}, ...}
Every path is relative to kernels/NAME and must stay inside it (no "..", no absolute path, no
symlink out). Errors raise ParseError "FILE:LINE: what" (exit 4).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import yaml

from fleetctl.errors import ParseError

BACKENDS = ("cpu", "cuda", "triton")
DTYPES = ("float32", "float16", "bfloat16")
SOURCE_SUFFIXES = (".cpp", ".cc", ".cu")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_TOP_KEYS = {"name", "version", "backends", "reference", "test", "tolerances"}
_FLAG_KEYS = ("cflags", "cuda_cflags", "ldflags")
_TRITON_KEYS = {"module", "build", "load"}


@dataclass(frozen=True)
class Backend:
    """One compiled backend's sources (paths relative to the package) and compiler/linker flags."""

    sources: tuple[str, ...]
    cflags: tuple[str, ...] = ()
    cuda_cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()


@dataclass(frozen=True)
class TritonBackend:
    """The triton backend: `module` (a .py path relative to the package) and the names of its
    `build(arch: int, out_dir) -> manifest` (ahead-of-time compile) and `load(out_dir)` functions."""

    module: str
    build: str
    load: str


@dataclass(frozen=True)
class KernelPackage:
    """A validated kernel package rooted at `root` (kernels/NAME)."""

    name: str
    version: str
    root: Path
    backends: dict[str, Backend | TritonBackend]
    reference: str                       # "file.py:function"
    test: str                            # relative path of the test module
    tolerances: dict[str, tuple[float, float]]  # dtype -> (atol, rtol)

    def files(self) -> dict[str, bytes]:
        """Every regular file of the package: {posix relpath: content}, sorted, caches and the
        top-level `results/` (measurements about the package, not part of it) skipped.

        Raises ParseError for a symlink that leaves the package or is not a regular file.
        """
        out = {}
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__"
                                 and not (d == "results" and Path(dirpath) == self.root))
            for fn in filenames:
                if fn.endswith(".pyc"):
                    continue
                path = Path(dirpath, fn)
                rel = path.relative_to(self.root).as_posix()
                _inside(self.root, rel, f"{self.root / 'kernel.yaml'}:1: file {rel}")
                out[rel] = path.read_bytes()
        return dict(sorted(out.items()))

    def module_name(self, backend: str) -> str:
        """Name of the built extension module (and its .so file), e.g. verify_attention_cpu."""
        return f"{self.name}_{backend}"

    def build_params(self, backend: str) -> dict:
        """The `build` parameters of the kbuild probe that depend on the package (paths relative):
        {name, sources, cflags, cuda_cflags, ldflags} for cpu/cuda, {name, kind: "triton", module,
        build, load} for triton."""
        b = self.backends[backend]
        if isinstance(b, TritonBackend):
            return {"name": self.module_name(backend), "kind": "triton", "module": b.module, "build": b.build,
                    "load": b.load}
        return {"name": self.module_name(backend), "sources": list(b.sources), "cflags": list(b.cflags),
                "cuda_cflags": list(b.cuda_cflags), "ldflags": list(b.ldflags)}

    def test_params(self, backend: str) -> dict:
        """The `test` parameters of the kbuild probe that depend on the package; the triton build
        is tested on the device ("cuda"), like the cuda one."""
        return {"test": self.test, "reference": self.reference, "device": "cpu" if backend == "cpu" else "cuda",
                "tolerances": {k: list(v) for k, v in self.tolerances.items()}}


def load_package(kernels_root: Path, name: str) -> KernelPackage:
    """Load and validate kernels_root/NAME/kernel.yaml.

    Raises ParseError (exit 4) naming FILE:LINE for a malformed or missing field, a bad name, or a
    path (source, reference, test) that escapes the package directory.
    """
    kernels_root = Path(kernels_root)
    if not _IDENT.match(name):
        raise ParseError(f"{kernels_root}: kernel name {name!r} is not an identifier")
    root = kernels_root / name
    path = root / "kernel.yaml"
    if not root.resolve().is_relative_to(kernels_root.resolve()):
        raise ParseError(f"{root}: package directory leaves {kernels_root}")
    if not path.is_file():
        known = sorted(p.parent.name for p in kernels_root.glob("*/kernel.yaml"))
        raise ParseError(f"no kernel package {name!r}: {path} does not exist "
                         f"(packages in {kernels_root}: {', '.join(known) or 'none'})")
    try:
        doc = yaml.load(path.read_text(), Loader=_LineLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise ParseError(f"{path}:{mark.line + 1}: {e.problem or e.context}") from None
    at = _Where(path)
    top = at.mapping(doc, "kernel.yaml", _TOP_KEYS, required=_TOP_KEYS)
    if at.string(top, "name") != name:
        raise at.error(top, "name", f"name {top['name']!r} differs from the directory name {name!r}")
    version = at.string(top, "version")
    backends = {}
    bmap = at.mapping(top["backends"], "backends", set(BACKENDS), line=top.lines["backends"])
    if not bmap:
        raise at.error(top, "backends", "backends: at least one of cpu, cuda, triton is required")
    for bname, spec in bmap.items():
        where = f"backends.{bname}"
        if bname == "triton":
            backends[bname] = _triton_backend(at, root, spec, where, bmap.lines[bname])
            continue
        spec = at.mapping(spec, where, {"sources", *_FLAG_KEYS}, required={"sources"}, line=bmap.lines[bname])
        sources = at.strings(spec, "sources", where)
        if not sources:
            raise at.error(spec, "sources", f"{where}.sources: empty")
        for i, src in enumerate(sources):
            line = spec["sources"].lines[i]
            if not src.endswith(SOURCE_SUFFIXES):
                raise ParseError(f"{path}:{line}: {where}.sources: {src!r} is not one of {SOURCE_SUFFIXES}")
            _inside(root, src, f"{path}:{line}: {where}.sources")
        flags = {k: tuple(at.strings(spec, k, where)) for k in _FLAG_KEYS if k in spec}
        backends[bname] = Backend(sources=tuple(sources), **flags)
    reference = at.string(top, "reference")
    ref_file, _, ref_func = reference.partition(":")
    if not ref_file.endswith(".py") or not _IDENT.match(ref_func):
        raise at.error(top, "reference", f"reference: {reference!r} is not FILE.py:FUNCTION")
    _inside(root, ref_file, f"{path}:{top.lines['reference']}: reference")
    test = at.string(top, "test")
    _inside(root, test, f"{path}:{top.lines['test']}: test")
    tol = at.mapping(top["tolerances"], "tolerances", set(DTYPES), line=top.lines["tolerances"])
    if not tol:
        raise at.error(top, "tolerances", "tolerances: at least one dtype is required")
    tolerances = {}
    for dtype, t in tol.items():
        where = f"tolerances.{dtype}"
        t = at.mapping(t, where, {"atol", "rtol"}, required={"atol", "rtol"}, line=tol.lines[dtype])
        tolerances[dtype] = (at.number(t, "atol", where), at.number(t, "rtol", where))
    return KernelPackage(name=name, version=version, root=root, backends=backends, reference=reference,
                         test=test, tolerances=tolerances)


def build_key(pkg: KernelPackage, backend: str, torch_version: str, cuda_version: str | None,
              nvcc_version: str | None, arch: str | None, triton_version: str | None = None) -> str:
    """sha256 hex over every package file, the backend's build parameters, torch/CUDA/nvcc
    versions and target arch, and for the triton backend the Triton version.

    torch_version: torch.__version__; cuda_version: torch.version.cuda; nvcc_version: "13.0";
    arch: TORCH_CUDA_ARCH_LIST value such as "9.0" (None for cpu); triton_version:
    triton.__version__ such as "3.6.0", which compiles (and bundles the ptxas of) the triton
    backend; it enters only that backend's key, so cpu/cuda keys are the ones they were. torch's
    own extension cache does not key on the arch, hence this key.
    """
    doc = {
        "name": pkg.name, "version": pkg.version, "backend": backend,
        "build": pkg.build_params(backend),
        "files": {rel: hashlib.sha256(data).hexdigest() for rel, data in pkg.files().items()},
        "torch": torch_version, "cuda": cuda_version, "nvcc": nvcc_version, "arch": arch,
    }
    if backend == "triton":
        doc["triton"] = triton_version
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _triton_backend(at: _Where, root: Path, spec, where: str, line: int) -> TritonBackend:
    """backends.triton: {module: FILE.py inside the package, build: NAME, load: NAME}."""
    spec = at.mapping(spec, where, _TRITON_KEYS, required=_TRITON_KEYS, line=line)
    module = at.string(spec, "module")
    if not module.endswith(".py"):
        raise at.error(spec, "module", f"{where}.module: {module!r} is not a .py file")
    _inside(root, module, f"{at.path}:{spec.lines['module']}: {where}.module")
    names = {}
    for key in ("build", "load"):
        names[key] = at.string(spec, key)
        if not _IDENT.match(names[key]):
            raise at.error(spec, key, f"{where}.{key}: {names[key]!r} is not a function name")
    return TritonBackend(module=module, **names)


def _inside(root: Path, rel: str, what: str) -> None:
    """Raise ParseError unless `rel` is a relative path that resolves to a file inside `root`."""
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or not rel:
        raise ParseError(f"{what}: {rel!r} leaves the package directory")
    full = root / p
    if not full.resolve().is_relative_to(root.resolve()):
        raise ParseError(f"{what}: {rel!r} is a symlink out of the package directory")
    if not full.is_file():
        raise ParseError(f"{what}: {rel!r} is not a file in {root}")


class _LinedDict(dict):
    """A YAML mapping that remembers its own line and each key's line (1-based)."""

    line = 1

    def __init__(self):
        super().__init__()
        self.lines = {}


class _LinedList(list):
    """A YAML sequence that remembers its line and each item's line (1-based)."""

    line = 1

    def __init__(self):
        super().__init__()
        self.lines = []


class _LineLoader(yaml.SafeLoader):
    """SafeLoader whose mappings and sequences carry line numbers; duplicate keys are errors."""


def _construct_mapping(loader, node):
    loader.flatten_mapping(node)
    d = _LinedDict()
    d.line = node.start_mark.line + 1
    for knode, vnode in node.value:
        key = loader.construct_object(knode, deep=True)
        if key in d:
            raise yaml.MarkedYAMLError(problem=f"duplicate key {key!r}", problem_mark=knode.start_mark)
        d[key] = loader.construct_object(vnode, deep=True)
        d.lines[key] = knode.start_mark.line + 1
    return d


def _construct_sequence(loader, node):
    seq = _LinedList()
    seq.line = node.start_mark.line + 1
    for item in node.value:
        seq.append(loader.construct_object(item, deep=True))
        seq.lines.append(item.start_mark.line + 1)
    return seq


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)


class _Where:
    """Typed field access on line-carrying YAML nodes; failures become ParseError FILE:LINE."""

    def __init__(self, path: Path):
        self.path = path

    def error(self, node: _LinedDict, key: str, msg: str) -> ParseError:
        return ParseError(f"{self.path}:{node.lines.get(key, node.line)}: {msg}")

    def mapping(self, node, where: str, allowed: set, required: set = frozenset(), line: int = 1) -> _LinedDict:
        if not isinstance(node, _LinedDict):
            raise ParseError(f"{self.path}:{getattr(node, 'line', line)}: {where}: expected a mapping")
        for key in node:
            if key not in allowed:
                raise self.error(node, key, f"{where}: unknown field {key!r} (allowed: {', '.join(sorted(allowed))})")
        for key in sorted(required - node.keys()):
            raise ParseError(f"{self.path}:{node.line}: {where}: missing field {key!r}")
        return node

    def string(self, node: _LinedDict, key: str) -> str:
        value = node[key]
        if not isinstance(value, str) or not value:
            raise self.error(node, key, f"{key}: expected a non-empty string (quote it), got {value!r}")
        return value

    def strings(self, node: _LinedDict, key: str, where: str) -> list[str]:
        value = node[key]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(node, key, f"{where}.{key}: expected a list of strings")
        return value

    def number(self, node: _LinedDict, key: str, where: str) -> float:
        value = node[key]
        try:
            number = float(value)  # PyYAML reads 1e-5 (no dot) as a string
        except (TypeError, ValueError):
            number = -1.0
        if isinstance(value, bool) or not number >= 0:
            raise self.error(node, key, f"{where}.{key}: expected a number >= 0, got {value!r}")
        return number
