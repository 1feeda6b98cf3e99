"""Reference test run on the host before activation: the built module against reference.py.

    python test_kernel.py --module BUILD/verify_attention_cpu.so --device cpu \
        --reference reference.py:verify_attention_ref --tolerances '{"float32": [2e-5, 1e-4], ...}'

Both entries are checked: `verify_attention` (the package's req_to_token layout) and
`verify_attention_sglang` (SGLang's target-verify layout, inputs built by sglang_layout.py the way
SGLang's Triton backend builds them: the FULL_MASK as an eager bool tensor or in a longer uint8
graph buffer, whose prefix columns are garbage in every other case, and one causal-chain case with
custom_mask None); a case says which in "layout" ("req_to_token", "sglang-bool", "sglang-uint8",
"sglang-none"). The SGLang entry must write every row of `o` in place and return None.

Prints one JSON line {"ok", "seed", "device", "cases", "failures"} and exits 0 when every case is
within tolerance (|out - ref| <= atol + rtol * |ref| elementwise), 1 otherwise. Inputs are fresh
random draws each run (the seed is reported so a failure can be replayed with --seed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
# (B, T, prefix_lens, Hkv, G, D, req_to_token dtype, one mask shared by all requests)
SHAPES = [
    (2, 8, [37, 100], 2, 4, 128, torch.int32, False),
    (1, 1, [0], 1, 1, 64, torch.int64, True),
    (3, 16, [300, 0, 5], 1, 8, 64, torch.int32, True),
    (2, 4, [1030, 3], 2, 2, 256, torch.int64, False),
]
DTYPES = {"cpu": ["float32", "float16", "bfloat16"], "cuda": ["float16", "bfloat16"]}
SPLITS = {"cpu": [0], "cuda": [0, 3]}


def load_module(path: str | os.PathLike):
    """Import a built extension from its file; the module name is the file name up to the first dot."""
    name = Path(path).name.split(".")[0]
    spec = importlib.util.spec_from_file_location(name, str(path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_function(spec: str, base: Path = HERE):
    """`file.py:function` relative to `base` -> the function."""
    file, _, func = spec.partition(":")
    return getattr(load_module(base / file), func)


def random_parents(T: int, gen: torch.Generator) -> list[int]:
    """A random draft tree in BFS order: token 0 (the last verified token) is the root."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, T)]


def make_inputs(B, T, prefix_lens, Hkv, G, D, dtype, device, gen, r2t_dtype=torch.int32, shared_mask=False):
    """Random inputs in the kernel's layout (see reference.py); slots scattered over a larger cache."""
    from reference import tree_mask_from_parents

    lens = [p + T for p in prefix_lens]
    num_slots = sum(lens) + 7
    perm = torch.randperm(num_slots, generator=gen)
    max_reqs, max_ctx = B + 2, max(lens) + 3
    req_to_token = torch.zeros(max_reqs, max_ctx, dtype=r2t_dtype)
    rows = torch.randperm(max_reqs, generator=gen)[:B]
    start = 0
    for b, n in enumerate(lens):
        req_to_token[rows[b], :n] = perm[start:start + n].to(r2t_dtype)
        start += n
    masks = [tree_mask_from_parents(random_parents(T, gen)) for _ in range(1 if shared_mask else B)]
    mask = masks[0] if shared_mask else torch.stack(masks)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    return dict(q=randn(B * T, Hkv * G, D), k_cache=randn(num_slots, Hkv, D), v_cache=randn(num_slots, Hkv, D),
                req_to_token=req_to_token.to(device), req_pool_indices=rows.to(device),
                prefix_lens=torch.tensor(prefix_lens, dtype=torch.int64, device=device),
                tree_mask=mask.to(device), sm_scale=D ** -0.5)


def sglang_call(mod, x: dict, mask: str | None, splits: int, case_index: int):
    """verify_attention_sglang on x's inputs in SGLang's layout: the `o` it was given, NaN-filled
    before the call, so a row it did not write fails (None if it returned a value). Every other case
    leaves the FULL_MASK's prefix columns as garbage."""
    from sglang_layout import target_verify_args

    a = target_verify_args(x, mask, "garbage" if case_index % 2 else "true")
    returned = mod.verify_attention_sglang(**a, num_splits=splits)
    return a["o"] if returned is None else None


def run(module_path: str, device: str, tolerances: dict, reference: str = "reference.py:verify_attention_ref",
        seed: int | None = None) -> dict:
    """Compare the module's two entries with the reference over SHAPES x dtypes (x splits on CUDA):
    verify_attention, then verify_attention_sglang with the FULL_MASK (bool for even shapes, the uint8
    graph buffer for odd ones), and once per dtype a causal chain with custom_mask None.

    tolerances: {dtype name: [atol, rtol]}. Returns {"ok", "seed", "device", "cases", "failures"}.
    """
    sys.path.insert(0, str(HERE))
    from reference import tree_mask_from_parents

    mod = load_module(module_path)
    ref = load_function(reference)
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    gen = torch.Generator().manual_seed(seed)
    cases = []

    def record(got, want, atol, rtol, **facts):
        ok = got is not None and bool(torch.isfinite(got).all())
        err = (got.double() - want).abs() if ok else None
        ok = ok and bool((err <= atol + rtol * want.abs()).all())
        cases.append({**facts, "max_abs_err": float(err.max()) if err is not None else None, "ok": ok})

    for i, (B, T, plens, Hkv, G, D, r2t_dtype, shared) in enumerate(SHAPES):
        for dtype in DTYPES[device]:
            atol, rtol = tolerances[dtype]
            x = make_inputs(B, T, plens, Hkv, G, D, getattr(torch, dtype), device, gen, r2t_dtype, shared)
            want = ref(**x)
            runs = [("req_to_token", x, want), ("sglang-uint8" if i % 2 else "sglang-bool", x, want)]
            if i == 0:                       # the same inputs with a causal chain, custom_mask None
                chain = dict(x, tree_mask=tree_mask_from_parents(list(range(-1, T - 1))).to(device))
                runs.append(("sglang-none", chain, ref(**chain)))
            facts = {"B": B, "T": T, "prefix_lens": plens, "Hkv": Hkv, "G": G, "D": D, "dtype": dtype}
            for splits in SPLITS[device]:
                for layout, xs, want_ in runs:
                    if layout == "req_to_token":
                        got = mod.verify_attention(**xs, num_splits=splits)
                    else:
                        got = sglang_call(mod, xs, {"sglang-bool": "bool", "sglang-uint8": "uint8"}.get(layout),
                                          splits, i)
                    record(got, want_, atol, rtol, **facts, num_splits=splits, layout=layout)
    failures = [c for c in cases if not c["ok"]]
    return {"ok": not failures, "seed": seed, "device": device, "cases": cases, "failures": failures}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--module", required=True, help="path of the built extension (.so)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--reference", default="reference.py:verify_attention_ref")
    ap.add_argument("--tolerances", required=True, help='JSON {"dtype": [atol, rtol]}')
    ap.add_argument("--seed", type=int)
    a = ap.parse_args(argv)
    result = run(a.module, a.device, json.loads(a.tolerances), a.reference, a.seed)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
