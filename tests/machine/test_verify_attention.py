"""kernels/verify_attention: the CPU backend against the float64 reference, tree-mask semantics, the
reference against torch SDPA, the CUDA sources compiled for sm_90 and sm_120, and (marked `gpu`, on
a machine with a CUDA device) the CUDA backend built and run against the reference.

Without nvcc, CUDA headers or a device those tests skip; FLEETCTL_REQUIRE_CUDA=1 makes them fail."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import missing
from fleetctl.engine.kernels.package import load_package

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
PKG = load_package(KERNELS, "verify_attention")
sys.path.insert(0, str(PKG.root))
import test_kernel  # noqa: E402
from reference import tree_mask_from_parents, verify_attention_ref  # noqa: E402

NVCC = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
# the compile checks go through ccache where it is installed, as torch's own builds do: the same
# source, headers, flags and compiler are compiled once per machine (a changed one compiles again)
CCACHE = [shutil.which("ccache")] if shutil.which("ccache") else []


def compile_here(tmp_path: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """Run the g++ command `argv` (paths in it relative to tmp_path, which holds a copy of the
    package's csrc/) in tmp_path, through ccache with tmp_path as its base_dir: the command the
    cache sees is the same whatever the run's tmp_path or the checkout's path."""
    shutil.copytree(PKG.root / "csrc", tmp_path / "csrc", dirs_exist_ok=True)
    return subprocess.run([*CCACHE, *argv], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=dict(os.environ, CCACHE_BASEDIR=str(tmp_path)))
# The -D flags torch.utils.cpp_extension passes to nvcc: the kernel must not rely on half operators.
TORCH_NVCC_DEFINES = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                      "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__"]


@pytest.fixture(scope="session")
def cpu_module(cpu_kernel):
    """The run's one CPU build (conftest's `cpu_kernel`, kernel.yaml's flags) imported: (module, .so path)."""
    path = cpu_kernel[3]["module_path"]
    return test_kernel.load_module(path), path


def _check(mod, x, dtype):
    atol, rtol = PKG.tolerances[dtype]
    got = mod.verify_attention(**x).double()
    want = verify_attention_ref(**x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
# KV heads and the GQA group vary independently (review M6): several KV heads *and* a group > 1,
# so that a query head mapped to the wrong KV head shows; each such pair with both head dims
@pytest.mark.parametrize("Hkv, G, D", [(2, 1, 64), (1, 8, 128), (2, 4, 64), (2, 4, 128), (4, 2, 64),
                                       (4, 2, 128)])
@pytest.mark.parametrize("prefix", [0, 1, 4097])
@pytest.mark.parametrize("T", [1, 8, 64])
def test_cpu_backend_matches_reference(cpu_module, T, prefix, Hkv, G, D, dtype):
    gen = torch.Generator().manual_seed(T * 100003 + prefix * 101 + Hkv * 31 + G * 7 + D)
    x = test_kernel.make_inputs(2, T, [prefix, prefix // 2], Hkv, G, D, getattr(torch, dtype), "cpu", gen,
                                r2t_dtype=torch.int64 if D == 64 else torch.int32, shared_mask=(G in (1, 4)))
    _check(cpu_module[0], x, dtype)


def test_tree_mask_from_parents():
    #        0
    #      /   \
    #     1     2
    #    / \    |
    #   3   4   5
    mask = tree_mask_from_parents([-1, 0, 0, 1, 1, 2])
    want = torch.tensor([[1, 0, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0, 0],
                         [1, 0, 1, 0, 0, 0],
                         [1, 1, 0, 1, 0, 0],
                         [1, 1, 0, 0, 1, 0],
                         [1, 0, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask, want)
    with pytest.raises(ValueError, match="precede"):
        tree_mask_from_parents([-1, 2, 0])


def test_tree_mask_semantics_on_cpu_backend(cpu_module):
    """Token 3 (parent 1, grandparent 0) sees the prefix, 0, 1, itself, and nothing of 2, 4, 5."""
    mod = cpu_module[0]
    parents = [-1, 0, 0, 1, 1, 2]
    gen = torch.Generator().manual_seed(5)
    x = test_kernel.make_inputs(1, 6, [40], 2, 4, 64, torch.float32, "cpu", gen)
    x["tree_mask"] = tree_mask_from_parents(parents)
    _check(mod, x, "float32")
    base = mod.verify_attention(**x)
    row = slice(3, 4)
    slots = x["req_to_token"][int(x["req_pool_indices"][0])]
    for draft, visible in [(0, True), (1, True), (2, False), (3, True), (4, False), (5, False)]:
        y = dict(x, k_cache=x["k_cache"].clone())
        y["k_cache"][int(slots[40 + draft])] += 3.0
        changed = not torch.equal(mod.verify_attention(**y)[row], base[row])
        assert changed == visible, f"draft token {draft}: visible={visible} but changed={changed}"


def test_reference_matches_sdpa():
    """The float64 ground truth agrees with torch's SDPA run per request on the K/V gathered through
    req_to_token and that request's own tree mask: two requests, different prefix lengths (L12)."""
    gen = torch.Generator().manual_seed(11)
    B, T, Hkv, G, D = 2, 8, 2, 4, 64
    prefixes = [50, 13]
    x = test_kernel.make_inputs(B, T, prefixes, Hkv, G, D, torch.float64, "cpu", gen)
    assert x["tree_mask"].shape == (B, T, T) and not torch.equal(x["tree_mask"][0], x["tree_mask"][1])
    got = verify_attention_ref(**x)
    for b, P in enumerate(prefixes):
        slots = x["req_to_token"][int(x["req_pool_indices"][b]), : P + T].long()
        k = x["k_cache"][slots].transpose(0, 1)[None]     # [1, Hkv, L, D]
        v = x["v_cache"][slots].transpose(0, 1)[None]
        q = x["q"][b * T:(b + 1) * T].view(1, T, Hkv * G, D).transpose(1, 2)
        mask = torch.ones(T, P + T, dtype=torch.bool)
        mask[:, P:] = x["tree_mask"][b]
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=x["sm_scale"], enable_gqa=True)
        torch.testing.assert_close(got[b * T:(b + 1) * T], want.transpose(1, 2).reshape(T, Hkv * G, D))


def test_row_without_visible_keys_is_zero(cpu_module):
    gen = torch.Generator().manual_seed(3)
    x = test_kernel.make_inputs(1, 4, [0], 1, 2, 64, torch.float32, "cpu", gen)
    x["tree_mask"] = torch.zeros(4, 4, dtype=torch.bool)
    assert torch.equal(cpu_module[0].verify_attention(**x), torch.zeros(4, 2, 64))
    assert torch.equal(verify_attention_ref(**x), torch.zeros(4, 2, 64, dtype=torch.float64))


def test_cpu_backend_rejects_bad_inputs(cpu_module):
    mod = cpu_module[0]
    gen = torch.Generator().manual_seed(4)
    x = test_kernel.make_inputs(2, 4, [10, 3], 1, 2, 64, torch.float32, "cpu", gen)
    with pytest.raises(RuntimeError, match="B\\*T rows"):
        mod.verify_attention(**dict(x, q=x["q"][:-1]))
    with pytest.raises(RuntimeError, match="exceeds req_to_token width"):
        mod.verify_attention(**dict(x, prefix_lens=torch.tensor([10_000, 3])))
    with pytest.raises(RuntimeError, match="slot id out of range"):
        mod.verify_attention(**dict(x, k_cache=x["k_cache"][:5], v_cache=x["v_cache"][:5]))


def test_test_kernel_script_passes_on_cpu_backend(cpu_module):
    tol = {k: list(v) for k, v in PKG.tolerances.items()}
    result = test_kernel.run(cpu_module[1], "cpu", tol, seed=20240611)
    assert result["ok"], (result["seed"], result["failures"])
    # both entries: the req_to_token one and the SGLang-layout one per shape and dtype, and once per
    # dtype the SGLang entry on a causal chain with custom_mask None
    assert len(result["cases"]) == len(test_kernel.SHAPES) * 3 * 2 + 3
    assert {c["layout"] for c in result["cases"]} == {"req_to_token", "sglang-bool", "sglang-uint8", "sglang-none"}


def test_bench_runs_on_cpu(cpu_module):
    """bench.py end to end (reference check, timing loop, table) on the CPU backend."""
    r = subprocess.run([sys.executable, str(PKG.root / "bench.py"), "--device", "cpu", "--module", cpu_module[1],
                        "--prefixes", "64,256", "--iters", "2", "--warmup", "1", "--batch", "2", "--hq", "4",
                        "--hkv", "2", "--dim", "64"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "reference check: ok" in r.stdout
    rows = [line.split() for line in r.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["64", "256"]
    assert all(float(row[-1]) < 1e-2 for row in rows)  # kernel vs SDPA baseline, bf16


@pytest.mark.slow
@pytest.mark.parametrize("sm", ["90", "120"])
def test_cuda_kernel_compiles(tmp_path, sm):
    if not Path(NVCC).exists():
        missing("nvcc not installed", "FLEETCTL_REQUIRE_CUDA")
    obj = tmp_path / f"verify_attention_sm{sm}.o"
    # not run from a copy: through ccache, nvcc from a copy in another directory was seen to miss
    # (base_dir or not), from this checkout's own path it hits
    r = subprocess.run([*CCACHE, NVCC, "-c", "-std=c++17", "-O3", *TORCH_NVCC_DEFINES, "-gencode",
                        f"arch=compute_{sm},code=sm_{sm}", str(PKG.root / "csrc" / "verify_attention.cu"),
                        "-o", str(obj)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert obj.stat().st_size > 0
    assert f"sm_{sm}".encode() in obj.read_bytes()  # the embedded cubin names its arch


@pytest.mark.slow
def test_cuda_binding_compiles_against_torch_headers(tmp_path):
    """binding_cuda.cpp type-checks against torch's CUDA headers (syntax only, no linking).

    torch's CPU wheels ship c10/cuda headers but not the CMake-generated cuda_cmake_macros.h;
    a one-line stand-in is written for it.
    """
    cuda_include = Path(NVCC).resolve().parent.parent / "include"
    if not (cuda_include / "cuda_runtime_api.h").exists():
        cuda_include = Path("/usr/local/cuda/include")
    if not (cuda_include / "cuda_runtime_api.h").exists():
        missing("CUDA headers not installed", "FLEETCTL_REQUIRE_CUDA")
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    torch_inc = Path(torch.__file__).parent / "include"
    r = compile_here(tmp_path, ["g++", "-std=c++20", "-fsyntax-only", "-Wall",
                                "-DTORCH_EXTENSION_NAME=verify_attention_cuda", "-I.", "-isystem", str(torch_inc),
                                "-isystem", str(torch_inc / "torch/csrc/api/include"),
                                "-isystem", sysconfig.get_paths()["include"], "-isystem", str(cuda_include),
                                "csrc/binding_cuda.cpp"])
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.slow
def test_cuda_backend_matches_reference_on_gpu(tmp_path):
    """The CUDA backend built with kernel.yaml's flags, run by the package's own reference test on
    the device (both entries, the SGLang-layout one included; split-K and its log-sum-exp merge
    included: num_splits 0 and 3), then bench.py."""
    if not torch.cuda.is_available():
        missing("no CUDA device (torch.cuda.is_available() is false)", "FLEETCTL_REQUIRE_CUDA")
    from torch.utils.cpp_extension import load

    params = PKG.build_params("cuda")
    mod = load(name=params["name"], sources=[str(PKG.root / s) for s in params["sources"]],
               extra_cflags=params["cflags"], extra_cuda_cflags=params["cuda_cflags"],
               extra_ldflags=params["ldflags"], build_directory=str(tmp_path))
    tol = {k: list(v) for k, v in PKG.tolerances.items()}
    result = test_kernel.run(mod.__file__, "cuda", tol, seed=20240611)
    assert result["ok"], (result["seed"], result["failures"])
    assert {c["num_splits"] for c in result["cases"]} == {0, 3}
    assert len(result["cases"]) == (len(test_kernel.SHAPES) * 2 + 1) * len(test_kernel.DTYPES["cuda"]) * 2
    assert {c["layout"] for c in result["cases"]} == {"req_to_token", "sglang-bool", "sglang-uint8", "sglang-none"}
    r = subprocess.run([sys.executable, str(PKG.root / "bench.py"), "--device", "cuda", "--module", mod.__file__,
                        "--prefixes", "256,4096", "--iters", "2", "--warmup", "1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "reference check: ok" in r.stdout
