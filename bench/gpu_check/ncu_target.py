"""What stage 6 profiles under ncu: a backend's SGLang-layout entry on one speed shape. The warm-up
calls (Triton's JIT compiles there) run before cudaProfilerStart, so ncu started with
`--profile-from-start off` sees exactly one call's kernels (KERNELS[backend]: the name regex),
whatever their number (one without a split, two with the merge).

    python ncu_target.py --backend cuda --module BUILD/verify_attention_cuda.so --B 8 --T 64 --P 65536 --G 1 --D 256
    python ncu_target.py --backend triton --B 8 --T 4 --P 65536 --G 1 --D 128
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import load_backend, make_inputs, target_verify_args  # noqa: E402

# backend -> ncu kernel-name regex (split + merge / fwd + combine)
KERNELS = {"cuda": "regex:split_kernel|merge_kernel", "triton": "regex:_verify_fwd|_combine"}
WARMUP_CALLS = 2


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=sorted(KERNELS), required=True)
    ap.add_argument("--module")
    for k in ("B", "T", "P", "G", "D"):
        ap.add_argument(f"--{k}", type=int, required=True)
    a = ap.parse_args()
    mod = load_backend(a.backend, a.module)
    x = make_inputs(a.B, a.T, [a.P] * a.B, 8 // a.G, a.G, a.D, torch.bfloat16, "cuda", seed=1, shared_mask=True)
    args = target_verify_args(x, "uint8")
    for _ in range(WARMUP_CALLS):
        mod.verify_attention_sglang(**args)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    mod.verify_attention_sglang(**args)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
