"""The kernels compile for a real GPU (sm_90, Hopper) and their hot loads/stores are 128-bit vectorized.

Interpreter tests check the math but not that Triton can lower the kernels to PTX, nor that the
memory accesses are vectorized (the main condition for reaching copy bandwidth). Triton compiles
ahead of time without a GPU (its wheel ships ptxas), so this runs on CPU-only CI: a subprocess
without TRITON_INTERPRET compiles each kernel for GPUTarget("cuda", 90, 32) and reports PTX counts.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_SCRIPT = r'''
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton_kernels import cast, fused_adam, moe_permutation, unscale_norm

def ptx_counts(fn, types, consts, num_warps):
    names = fn.arg_names
    sig = {n: ("constexpr" if n in consts else types.get(n, "fp32")) for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n.endswith("_ptr") or n in ("n_elements", "hidden")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]
    return {p: len(re.findall(re.escape(p), ptx)) for p in ("ld.global.v4", "st.global.v4", "sqrt.rn")}

adam_types = dict(param_ptr="*fp32", grad_ptr="*bf16", exp_avg_ptr="*fp32", exp_avg_sq_ptr="*fp32",
                  out_lowp_ptr="*bf16", seg_bounds_ptr="*i64", seg_lr_ptr="*fp32", seg_wd_ptr="*fp32",
                  grad_scale_ptr="*fp32", found_inf_ptr="*fp32", n_elements="i64", num_segments="i32")
out = {}
for steps in (0, 2):
    out[f"adam_search{steps}"] = ptx_counts(
        fused_adam._fused_adam_kernel, adam_types,
        dict(SEARCH_STEPS=steps, DECOUPLED=True, HAS_SCALE_PTR=True, HAS_FOUND_INF=True, HAS_LOWP=True,
             BLOCK_SIZE=fused_adam.BLOCK_SIZE), fused_adam.NUM_WARPS)
out["unscale"] = ptx_counts(
    unscale_norm._unscale_norm_kernel,
    dict(grad_ptr="*fp32", partial_ptr="*fp32", found_inf_ptr="*fp32", inv_scale_ptr="*fp32", n_elements="i64"),
    dict(HAS_SCALE_PTR=True, BLOCK_SIZE=unscale_norm.BLOCK_SIZE), unscale_norm.NUM_WARPS)
out["cast"] = ptx_counts(cast._cast_kernel, dict(src_ptr="*fp32", dst_ptr="*bf16", n_elements="i64"),
                         dict(FROM_BF16=False, TO_BF16=True, BLOCK_SIZE=cast.BLOCK_SIZE), cast.NUM_WARPS)
out["gather"] = ptx_counts(
    moe_permutation._gather_rows_kernel,
    dict(src_ptr="*bf16", dst_ptr="*bf16", src_row_ptr="*i64", weight_ptr="*fp32", other_ptr="*bf16",
         dot_ptr="*fp32", hidden="i32"),
    dict(HAS_WEIGHT=True, HAS_DOT=True, ACC_DTYPE=triton.language.float32, BLOCK_H=1024), 4)
out["combine"] = ptx_counts(
    moe_permutation._combine_rows_kernel,
    dict(src_ptr="*bf16", dst_ptr="*bf16", row_map_ptr="*i64", gate_ptr="*fp32", hidden="i32"),
    dict(K=2, HAS_GATE=True, ACC_DTYPE=triton.language.float32, BLOCK_H=1024), 4)
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def ptx_counts():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fused_adam_compiles_vectorized(ptx_counts):
    for key in ("adam_search0", "adam_search2"):
        counts = ptx_counts[key]
        # fp32 param / exp_avg / exp_avg_sq and bf16 grad: 128-bit loads of every stream
        assert counts["ld.global.v4"] >= 4, (key, counts)
        assert counts["st.global.v4"] >= 4, (key, counts)  # param, exp_avg, exp_avg_sq, bf16 copy
        assert counts["sqrt.rn"] >= 1, (key, counts)  # IEEE sqrt as torch, not sqrt.approx


def test_other_kernels_compile_vectorized(ptx_counts):
    for key in ("unscale", "cast", "gather", "combine"):
        assert ptx_counts[key]["ld.global.v4"] >= 1, (key, ptx_counts[key])
        assert ptx_counts[key]["st.global.v4"] >= 1, (key, ptx_counts[key])
