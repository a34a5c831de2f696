"""The ``triton_short`` kernels compile for the H200 (CUDA sm_90) on a machine without a GPU: Triton lowers them
to PTX and runs its bundled ``ptxas``, in a subprocess (this test process runs Triton interpreted). Catches
compile errors of the GPU-only path -- e.g. in the masked / mask-free loop split -- before the GPU run; the
numbers are checked by tests/attn/test_triton_short.py (interpreter) and test_triton_short_gpu.py (GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget

    if "nvidia" not in backends:
        raise SystemExit(77)
    from benchmarks.triton_short_registers import int_values, launch_attrs, signature
    from varpack.attn import _triton_short_kernels as kern

    assert not kern.INTERPRETED
    for mask_free, pack, d, block_d, bm, bn, left, right in (
        (True, False, 128, 128, 64, 32, False, True),  # the D = 128 default, causal: unmasked head-dim loads
        (True, False, 96, 128, 64, 64, True, True),  # padded head dim, window on both sides
        (False, False, 128, 128, 64, 32, False, True),  # masked only
        (True, True, 128, 128, 64, 32, False, True),  # PackGQA: the group's heads as rows of the tile
        (False, True, 96, 128, 64, 64, True, True),  # PackGQA, masked only, padded head dim, window
    ):
        consts = dict(GROUP=4 if pack else 2, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=bm, BLOCK_N=bn, HAS_LEFT=left,
                      HAS_RIGHT=right, PRECISION="tf32", UPCAST=False, MASK_FREE=mask_free, PACK_GQA=pack,
                      LPT=mask_free)  # the longest-first tile order (1-D grid) and row order (2-D grid)
        for fn in (kern.attn_fwd, kern.attn_bwd_dkdv, kern.attn_bwd_dq):
            if "DELTA_IN_DQ" in fn.arg_names:  # delta computed in the dQ kernel, except in the masked-only case
                consts = dict(consts, DELTA_IN_DQ=mask_free or pack)
            else:
                consts.pop("DELTA_IN_DQ", None)
            if "DP_FIRST" in fn.arg_names:  # dP issued before the softmax, except with PackGQA off
                consts = dict(consts, DP_FIRST=pack)
            else:
                consts.pop("DP_FIRST", None)
            sig = signature(fn, consts)
            # specialized as a launch would be, and not at all (a launch on unaligned strides)
            attrs = launch_attrs(fn, sig, int_values(fn, 8, 2, d, 4096, pack)) if not left else {}
            src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
            assert compiled.asm["cubin"], fn.__name__
            print(fn.__name__, mask_free, pack, d, "ok")
    target = GPUTarget("cuda", 90, 32)
    i64 = ("KEY_LO", "KEY_HI", "QUERY_LO", "QUERY_HI", "LO", "HI")
    for fn, consts in (
        (kern.build_token_tables, dict(HAS_LEFT=False, HAS_RIGHT=True, GIVEN_DOC=False, SELF=True, STEPS=10, BLOCK=1024)),
        (kern.build_token_tables, dict(HAS_LEFT=True, HAS_RIGHT=True, GIVEN_DOC=True, SELF=False, STEPS=3, BLOCK=1024)),
        (kern.build_tile_tables, dict(TILE=16)),
        (kern.build_tile_tables, dict(TILE=128)),
    ):
        sig = {
            name: "constexpr" if name in consts else "*i64" if name in i64 else "*i32" if name.isupper() else "i32"
            for name in fn.arg_names
        }
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts)
        assert triton.compile(src, target=target, options={"num_warps": 4}).asm["cubin"], fn.__name__
        print(fn.__name__, "tables", "ok")
    """
)


def test_kernels_compile_for_sm90_with_and_without_mask_free_and_pack_gqa(tmp_path):
    """The attention kernels (mask-free split on / off, PackGQA on / off, delta in the dQ kernel on / off, the
    longest-first tile order on / off) and the two table kernels."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a real compile, not a cache hit
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    if done.returncode == 77:
        pytest.skip("this Triton has no NVIDIA backend")
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count(" ok") == 19, done.stdout
