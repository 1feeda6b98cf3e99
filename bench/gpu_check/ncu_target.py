"""What stage 4 profiles under ncu: the kernel on one speed shape, called twice (the first call is the
warm-up ncu skips with --launch-skip 2: one split_kernel and one merge_kernel launch per call).

    python ncu_target.py --module BUILD/verify_attention_cuda.so --B 8 --T 64 --P 65536 --G 1 --D 256
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import kargs, load_module, make_inputs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--module", required=True)
    for k in ("B", "T", "P", "G", "D"):
        ap.add_argument(f"--{k}", type=int, required=True)
    a = ap.parse_args()
    mod = load_module(a.module)
    x = make_inputs(a.B, a.T, [a.P] * a.B, 8 // a.G, a.G, a.D, torch.bfloat16, "cuda", seed=1, shared_mask=True)
    for _ in range(2):
        mod.verify_attention(**kargs(x))
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
