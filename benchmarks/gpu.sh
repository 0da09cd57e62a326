#!/usr/bin/env bash
# One prepared GPU run (<= 8 minutes, one GPU), from the checkout: no install, no network. Usage, from anywhere:
#   bash benchmarks/gpu.sh              # results under $OUT (or benchmarks/gpu_out): results.json, summary.md
#   bash benchmarks/gpu.sh --dry-run    # the CPU part only (tiny models, no CUDA needed)
# Sections (each with its own time cap; see benchmarks/gpu.py): env, kernels, adamw_bw, parity, opt_*.
# Exit status: 0 all ran and passed; 1 a section failed (summary.md says which); 2 no CUDA device.
set -uo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET                      # compile the Triton kernels for real
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT_DIR="${OUT:-$PWD/benchmarks/gpu_out}"
mkdir -p "$OUT_DIR"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > "$OUT_DIR/nvidia_smi.txt" 2>&1 || true
# 470 s hard limit (gpu.py budgets 450 s for its sections and clips each cap to what is left)
timeout --signal=TERM --kill-after=10 470 python benchmarks/gpu.py --out "$OUT_DIR" "$@" 2>&1 | tee "$OUT_DIR/gpu_log.txt"
status="${PIPESTATUS[0]}"
[ "$status" = 124 ] && echo "gpu.sh: gpu.py ran past 470 s; results.json holds the sections that finished" >&2
exit "$status"
