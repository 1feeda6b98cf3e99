"""Occupancy and split count per grid shape, from the static rule the host path runs (no GPU).

    python3 kernels/verify_attention/splits_report.py [--arch 90] [--sms 132]

For each of the 48 D 128 shapes of the GPU check's speed grid (Hq 8, Hkv = 8/G, G {1, 8}, B {1, 8},
T {4, 8, 9, 64}, P {4k, 16k, 64k}; bench/gpu_check/speed.py `shapes`) prints the configuration
(BLOCK_M x row tiles, warps/stages), resident CTAs per SM (`triton_verify.resident`), the split
count `pick_splits` gives with one request's key bound P + T, the programs launched and their share
of the resident slots (SMs x CTAs/SM), key tiles per program, and the fp32 partials' bytes as a
share of the K/V bytes. `rows(arch, sms)` returns the same as dicts (tests/machine/
test_verify_attention_triton.py checks them against kernel-turn4.md's targets).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import triton_verify as tv  # noqa: E402

HQ, D = 8, 128


def grid() -> list[dict]:
    """The 48 D 128 shapes: [{G, B, T, P}]."""
    return [dict(G=G, B=B, T=T, P=P) for G in (1, 8) for B in (1, 8) for T in (4, 8, 9, 64)
            for P in (4096, 16384, 65536)]


def rows(arch: int = 90, sms: int = 132) -> list[dict]:
    """Per shape of `grid()`: its keys plus bm, n_mt, warps, stages, ctas (per SM), S, programs,
    fill (programs / resident slots), tiles (key tiles per program, the largest), partials
    (fp32 partial bytes written / K/V bytes read; 0 without a split)."""
    out = []
    for s in grid():
        G, B, T, P = s["G"], s["B"], s["T"], s["P"]
        Hkv, M, L = HQ // G, T * G, P + T
        bm = tv.block_m(T, G)
        n_mt = -(-M // bm)
        block_n, warps, stages = tv.config(arch, D, bm)
        ctas = tv.resident(arch, D, bm)
        S = tv.pick_splits(B, Hkv, n_mt, sms, ctas, L, M, D, block_n)
        programs = B * Hkv * n_mt * S
        tiles = -(-(-(-L // S)) // block_n)
        partials = (S * B * M * Hkv * D * 4) / (B * L * Hkv * D * 4) if S > 1 else 0.0
        out.append(dict(s, bm=bm, n_mt=n_mt, warps=warps, stages=stages, ctas=ctas, S=S, programs=programs,
                        fill=programs / (sms * ctas), tiles=tiles, partials=partials))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--sms", type=int, default=132, help="SM count (132: H100 SXM / H200)")
    a = ap.parse_args()
    print(f"sm_{a.arch}, {a.sms} SMs, D {D}, Hq {HQ}")
    print(f"{'G':>2} {'B':>2} {'T':>3} {'P':>6} | {'BLOCK_M x n':>11} {'w/s':>4} {'CTA/SM':>6} | {'S':>4} "
          f"{'programs':>8} {'fill':>5} {'tiles/prog':>10} {'partials/KV':>11}")
    for r in rows(a.arch, a.sms):
        print(f"{r['G']:>2} {r['B']:>2} {r['T']:>3} {r['P']:>6} | {r['bm']:>6} x {r['n_mt']:<2} "
              f"{r['warps']}/{r['stages']:<2} {r['ctas']:>6} | {r['S']:>4} {r['programs']:>8} {r['fill']:>5.2f} "
              f"{r['tiles']:>10} {r['partials']:>11.3f}")


if __name__ == "__main__":
    main()
