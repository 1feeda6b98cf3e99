#!/usr/bin/env bash
# GPU proof of kernels/verify_attention in one command (stages 0-7, see bench/gpu_check/check.py):
#
#   bash bench/gpu_check.sh                    # on the GPU machine: writes $OUT/gpu_check.{json,md,log}
#   bash bench/gpu_check.sh --stage speed      # rerun only the speed stage (the others keep their records)
#   bash bench/gpu_check.sh --stages 2,3       # the same by stage numbers
#   bash bench/gpu_check.sh --backend cuda     # the new kernel is the CUDA backend (default: triton)
#   bash bench/gpu_check.sh --cpu --out DIR    # the same script on a CPU: CPU backend, smallest shapes,
#                                              # SGLang's Triton kernels under TRITON_INTERPRET=1
#
# One 15-minute device slot (issue 53): `timeout 300 bash bench/gpu_check.sh --stages 0,2,3,4,5,6`, then
# `timeout 120 bash bench/gpu_check.sh --stage speed` to rerun the speed stage alone. The Triton kernels are
# built ahead of time first (60 per arch, 8 processes; ~15-33 s expected on 16 cores, 400 s measured with
# 2 processes on a loaded 2-core CPU) and loaded as deploy loads them: budgets and figures in
# kernels/verify_attention/results/README.md.
#
# Needs python3 with torch, pyyaml (and triton for the SGLang baseline, nvcc for the CUDA build);
# not fleetctl's own dependencies: stage 1 runs fleetctl as `PYTHONPATH=agent python3 -m fleetctl.cli`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -u bench/gpu_check/check.py "$@"
