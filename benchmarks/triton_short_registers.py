"""Registers, spills and shared memory of the ``triton_short`` kernels compiled for the H200 (CUDA sm_90a) on a
machine without a GPU: Triton compiles each kernel to PTX, then its bundled ``ptxas -v`` reports registers per
thread and spill bytes. Per kernel the table gives the launch config and register cap the call would use
(:func:`varpack.attn.triton_short._launch_blocks`, :meth:`~varpack.attn.triton_short.TritonShortConfig.registers`),
and how many programs fit one SM by registers and by shared memory: the occupancy a register cap
(:data:`varpack.attn.triton_short.MAXNREG`) trades against spills.

Not a timing. It says which caps are worth a same-run variant on the GPU (``benchmarks/attention.py
--ts-variant``); only that decides (eleventh session: the forward capped at 128 registers spills ~1.4 KB and runs
8% faster on the real mix, benchmarks/RESULTS.md).

    python benchmarks/triton_short_registers.py --heads 16/4 --head-dim 128 --mean 207
    python benchmarks/triton_short_registers.py --config '{"maxnreg": {"bwd_dq": 168}}'

Limits per SM on sm_90 (CUDA C++ Programming Guide, compute capability 9.0): 65,536 registers, allocated per warp
in units of 256 (8 per thread); 228 KB of shared memory, 1 KB of it reserved per program; 32 programs, 64 warps.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024
SHARED_RESERVED = 1024
MAX_PROGRAMS, MAX_WARPS = 32, 64
#: pointer arguments by element type (the rest named in upper case are the bf16 / fp16 tensors)
INT32_ARGS = ("DOC_Q", "DOC_K", "LIM", "TILE_LO", "TILE_HI", "FULL_LO", "FULL_HI", "ORDER")
FP32_ARGS = ("LSE", "DELTA")


def signature(fn, consts: dict, dtype: str = "bf16") -> dict[str, str]:
    """Triton signature of an attention kernel of :mod:`varpack.attn._triton_short_kernels` for a compile without
    launching it: constexprs, int32 tables, fp32 lse / delta, ``dtype`` tensors, fp32 scales, int32 scalars."""
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in INT32_ARGS:
            sig[name] = "*i32"
        elif name in FP32_ARGS:
            sig[name] = "*fp32"
        elif name.isupper():
            sig[name] = f"*{dtype}"
        else:
            sig[name] = "fp32" if name.endswith("scale") else "i32"
    return sig


def ptxas_report(ptx: str, ptxas: str, arch: str = "sm_90a") -> dict[str, int]:
    """``{"registers", "spill_stores", "spill_loads"}`` of the one kernel in ``ptx`` (``ptxas -v``).

    Raises:
        RuntimeError: ptxas failed, or its report has no register count.
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        done = subprocess.run(
            [ptxas, "-v", "--gpu-name", arch, path, "-o", os.path.join(tmp, "kernel.cubin")],
            capture_output=True,
            text=True,
        )
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed: {done.stderr[-2000:]}")
    regs = re.search(r"Used (\d+) registers", done.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    if regs is None:
        raise RuntimeError(f"no register count in ptxas's report: {done.stderr[-2000:]}")
    stores, loads = (int(spills.group(1)), int(spills.group(2))) if spills else (0, 0)
    return {"registers": int(regs.group(1)), "spill_stores": stores, "spill_loads": loads}


def programs_per_sm(registers: int, shared: int, warps: int) -> dict[str, int]:
    """Programs of ``warps`` warps that fit one sm_90 SM by registers (``registers`` per thread, rounded up to 8)
    and by shared memory (``shared`` bytes per program), each also bounded by the SM's program and warp limits."""
    per_program = -(-registers // 8) * 8 * 32 * warps
    cap = min(MAX_PROGRAMS, MAX_WARPS // warps)
    return {
        "by_registers": min(cap, REGISTERS_PER_SM // per_program),
        "by_shared": min(cap, SHARED_PER_SM // (shared + SHARED_RESERVED)),
    }


def report(
    heads: str, head_dim: int, mean: float | None, config_json: str, causal: bool = True
) -> list[dict]:
    """One row per kernel (forward, dQ, dK/dV) as a call of these shapes would launch it."""
    import triton
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget

    if "nvidia" not in backends:
        raise SystemExit("this Triton has no NVIDIA backend (needed to compile for sm_90)")
    from triton.backends.nvidia.compiler import get_ptxas

    from varpack.attn import _triton_short_kernels as kern
    from varpack.attn import triton_short as ts

    if kern.INTERPRETED:
        raise SystemExit("unset TRITON_INTERPRET: this compiles the kernels for the GPU")
    h, hkv = (int(x) for x in heads.split("/"))
    group = h // hkv
    config = ts.TritonShortConfig.from_json(config_json)
    ptxas = get_ptxas(90).path
    rows = []
    for kind, fn in (("fwd", kern.attn_fwd), ("bwd_dq", kern.attn_bwd_dq), ("bwd_dkdv", kern.attn_bwd_dkdv)):
        (block_m, block_n, warps, stages), pack, _ = ts._launch_blocks(config, kind, head_dim, group, mean)
        cap = config.registers(kind, head_dim)
        consts = dict(
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=ts._head_block(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
            HAS_LEFT=False, HAS_RIGHT=causal, PRECISION="tf32", UPCAST=False, MASK_FREE=config.mask_free,
            PACK_GQA=pack, LPT=config.lpt,
        )  # fmt: skip
        if "DELTA_IN_DQ" in fn.arg_names:
            consts["DELTA_IN_DQ"] = config.delta_in_dq
        options = {"num_warps": warps, "num_stages": stages, **({"maxnreg": cap} if cap else {})}
        src = triton.compiler.ASTSource(fn=fn, signature=signature(fn, consts), constexprs=consts)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        row = {"kernel": kind, "config": [block_m, block_n, warps, stages], "pack_gqa": pack, "maxnreg": cap}
        row.update(ptxas_report(compiled.asm["ptx"], ptxas))
        row["shared"] = int(compiled.metadata.shared)
        row.update(programs_per_sm(row["registers"], row["shared"], warps))
        rows.append(row)
    return rows


def _heads(text: str) -> str:
    """``H/Hkv`` with ``Hkv`` dividing ``H`` (argparse type: a clear error otherwise)."""
    try:
        h, hkv = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--heads: need H/Hkv such as 16/4, got {text!r}") from None
    if h < 1 or hkv < 1 or h % hkv:
        raise argparse.ArgumentTypeError(f"--heads {text}: Hkv must be >= 1 and divide H")
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=_heads, default="16/4", help="H/Hkv (default 16/4)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--mean", type=float, default=None, help="mean document length (tokens): PackGQA's rule")
    p.add_argument("--config", default="", help="VARPACK_TRITON_SHORT_CONFIG JSON (default: the defaults)")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    rows = report(args.heads, args.head_dim, args.mean, args.config)
    print(
        f"# triton_short on sm_90a, H={args.heads}, D={args.head_dim}, mean={args.mean}, config {args.config or '{}'}"
    )
    print("| kernel | config | PackGQA | maxnreg | registers | spill stores / loads (B) | shared (KB) |"
          " programs / SM by registers | by shared memory |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['kernel']} | {tuple(r['config'])} | {r['pack_gqa']} | {r['maxnreg'] or '-'} | {r['registers']} | "
            f"{r['spill_stores']} / {r['spill_loads']} | {r['shared'] / 1024:.1f} | {r['by_registers']} | "
            f"{r['by_shared']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
