#!/usr/bin/env bash
# One prepared GPU benchmark run (<= 8 minutes, one GPU). Usage, from the repository root:
#   bash benchmarks/gpu.sh            # results under $OUT (or benchmarks/gpu_out)
# Fails loudly: any error exits non-zero with the reason on stderr (see benchmarks/gpu.py).
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET                      # compile Triton kernels for real
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT_DIR="${OUT:-$PWD/benchmarks/gpu_out}"
mkdir -p "$OUT_DIR"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv 2>&1 | tee "$OUT_DIR/nvidia_smi.txt" || true
python -c "import torch; assert torch.cuda.is_available(), 'torch ' + torch.__version__ + ' sees no CUDA device'; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
# the Triton kernels against copy bandwidth and torch's fused AdamW (issue #3 targets), <= 60 s
timeout --signal=TERM --kill-after=5 60 python benchmarks/kernels.py 2>&1 | tee "$OUT_DIR/kernels.txt" || echo "kernels.py failed (see kernels.txt)" >&2
# 410 s hard limit for the training runs + slack for the report (whole script <= 8 minutes)
timeout --signal=TERM --kill-after=10 410 python benchmarks/gpu.py --out "$OUT_DIR" "$@" 2>&1 | tee "$OUT_DIR/gpu_log.txt"
exit "${PIPESTATUS[0]}"
