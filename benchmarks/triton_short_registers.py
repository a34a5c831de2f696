"""Registers, spills and shared memory of the ``triton_short`` kernels compiled for the H200 (CUDA sm_90a) on
a machine without a GPU: Triton compiles each kernel to PTX, then its bundled ``ptxas -v`` reports registers
per thread and spill bytes. Per kernel the table gives the launch config and register cap the call would use
(:func:`varpack.attn.triton_short._launch_blocks`,
:meth:`~varpack.attn.triton_short.TritonShortConfig.registers`), and how many programs fit one SM by registers
and by shared memory: the occupancy a register cap (:data:`varpack.attn.triton_short.MAXNREG`) trades against
spills.

Not a timing. It says which caps are worth a same-run variant on the GPU (``benchmarks/attention.py
--ts-variant``); only that decides (benchmarks/RESULTS.md#attention).

The compile specializes the arguments as a launch does (:func:`launch_attrs`: 16-divisible pointers and
integers); without that it compiles another kernel than the one a call runs (the dK/dV loop loads not
pipelined: spills and shared memory reported that the launched kernel does not have). ``--launched`` (GPU)
runs one call and prints what the driver loaded, to check this compile against.

    python benchmarks/triton_short_registers.py --heads 16/4 --head-dim 128 --mean 207
    python benchmarks/triton_short_registers.py --config '{"maxnreg": {"bwd_dq": 168}}'
    python benchmarks/triton_short_registers.py --heads 16/4 --mean 207 --launched   # GPU: and launched
    python benchmarks/triton_short_registers.py --small    # D = 64 and small tiles: a quicker compile (CPU)

Limits per SM on sm_90 (CUDA C++ Programming Guide, compute capability 9.0): 65,536 registers, allocated per
warp in units of 256 (8 per thread); 228 KB of shared memory, 1 KB of it reserved per program; 32 programs, 64
warps.
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
    """Triton signature of an attention kernel of :mod:`varpack.attn._triton_short_kernels` for a compile
    without launching it: constexprs, int32 tables, fp32 lse / delta, ``dtype`` tensors, fp32 scales, int32
    scalars."""
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


def int_values(fn, heads: int, kv_heads: int, head_dim: int, tokens: int, pack: bool) -> dict[str, int]:
    """The integer arguments a call of these shapes passes to kernel ``fn`` (contiguous ``[T, H, D]`` q / out
    / dO / dQ, ``[T, Hkv, D]`` k / v / dK / dV, ``[H, T]`` lse / delta; causal, no window), by argument
    name."""
    values = {
        "total_q": tokens,
        "total_k": tokens,
        "left": 0,
        "right": 0,
        "n_heads": kv_heads if pack else heads,
    }
    for name in fn.arg_names:
        if name.startswith("stride_"):
            tensor, axis = name[len("stride_") : -1], name[-1]
            width = kv_heads if tensor in ("k", "v", "dk", "dv") else heads
            values[name] = {"t": width * head_dim, "h": head_dim}[axis] if tensor != "l" else tokens
    return values


def launch_attrs(fn, sig: dict[str, str], values: dict[str, int]) -> dict[tuple[int], list]:
    """Triton's launch specialization of ``fn``'s arguments (``JITFunction.run``: a pointer whose address, or
    an integer whose value, is a multiple of 16 is marked ``tt.divisibility = 16``), for a compile without a
    launch. Every tensor counts as 16-byte aligned (PyTorch's allocations are); integers by ``values`` (left
    unmarked where unknown). Without these marks the compiler cannot vectorise the tile loads, and registers,
    spills and shared memory differ from the kernel a call runs."""
    attrs = {}
    for i, name in enumerate(fn.arg_names):
        kind = sig[name]
        if kind.startswith("*") or (kind == "i32" and name in values and values[name] % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


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
    """Programs of ``warps`` warps that fit one sm_90 SM by registers (``registers`` per thread, rounded up to
    8) and by shared memory (``shared`` bytes per program), each also bounded by the SM's program and warp
    limits."""
    per_program = -(-registers // 8) * 8 * 32 * warps
    cap = min(MAX_PROGRAMS, MAX_WARPS // warps)
    return {
        "by_registers": min(cap, REGISTERS_PER_SM // per_program),
        "by_shared": min(cap, SHARED_PER_SM // (shared + SHARED_RESERVED)),
    }


def report(
    heads: str, head_dim: int, mean: float | None, config_json: str, causal: bool = True, tokens: int = 65536
) -> list[dict]:
    """One row per kernel (forward, dQ, dK/dV) as a call of these shapes (``tokens`` packed tokens) would
    launch it, with the launch's argument specialization (:func:`launch_attrs`)."""
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
            GROUP=group,
            HEAD_DIM=head_dim,
            BLOCK_D=ts._head_block(head_dim),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            HAS_LEFT=False,
            HAS_RIGHT=causal,
            PRECISION="tf32",
            UPCAST=False,
            MASK_FREE=config.mask_free,
            PACK_GQA=pack,
            LPT=config.lpt,
        )
        if "DELTA_IN_DQ" in fn.arg_names:
            consts["DELTA_IN_DQ"] = config.delta_in_dq
        if "DP_FIRST" in fn.arg_names:
            consts["DP_FIRST"] = config.dp_first
        options = {"num_warps": warps, "num_stages": stages, **({"maxnreg": cap} if cap else {})}
        sig = signature(fn, consts)
        attrs = launch_attrs(fn, sig, int_values(fn, h, hkv, head_dim, tokens, pack))
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        row = {"kernel": kind, "config": [block_m, block_n, warps, stages], "pack_gqa": pack, "maxnreg": cap}
        row.update(ptxas_report(compiled.asm["ptx"], ptxas))
        row["shared"] = int(compiled.metadata.shared)
        row.update(programs_per_sm(row["registers"], row["shared"], warps))
        rows.append(row)
    return rows


def launched(
    heads: str, head_dim: int, mean: float | None, config_json: str, tokens: int = 65536
) -> list[dict]:
    """GPU: the kernels one triton_short forward + backward of these shapes actually launched (documents of
    ``mean`` tokens, default 128; bf16, causal), read from Triton's cache of compiled kernels: registers,
    spills (bytes) and shared memory as the driver loaded them -- the check of :func:`report`'s compile
    without a GPU."""
    import torch

    from varpack.attn import _triton_short_kernels as kern
    from varpack.attn.triton_short import TritonShortConfig, triton_short_attention

    if not torch.cuda.is_available():
        raise SystemExit("--launched needs a CUDA GPU")
    h, hkv = (int(x) for x in heads.split("/"))
    length = max(int(round(mean or 128)), 1)
    lengths = [length] * (tokens // length) + ([tokens % length] if tokens % length else [])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(tokens, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    k, v = (
        torch.randn(
            tokens, hkv, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen
        ).requires_grad_()
        for _ in range(2)
    )
    out, _ = triton_short_attention(q, k, v, cu, cu, config=TritonShortConfig.from_json(config_json))
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    rows = []
    for kind, fn in (("fwd", kern.attn_fwd), ("bwd_dq", kern.attn_bwd_dq), ("bwd_dkdv", kern.attn_bwd_dkdv)):
        for cache in (c[0] for c in fn.device_caches.values()):
            for compiled in cache.values():
                compiled._init_handles()
                md = compiled.metadata
                rows.append(
                    {"kernel": kind, "num_warps": md.num_warps, "num_stages": md.num_stages,
                     "registers": compiled.n_regs, "spills": compiled.n_spills, "shared": int(md.shared)}
                )  # fmt: skip
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
    p.add_argument("--tokens", type=int, default=65536, help="packed tokens T of the call (its lse stride)")
    p.add_argument("--config", default="", help="VARPACK_TRITON_SHORT_CONFIG JSON (default: the defaults)")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument(
        "--launched",
        action="store_true",
        help="GPU: also run one call of these shapes and print the kernels it launched (registers, spills, "
        "shared)",
    )
    p.add_argument(
        "--small", action="store_true", help="D = 64, small tiles (unless --config gives them): quicker"
    )
    args = p.parse_args(argv)
    if args.small:
        args.head_dim = 64
        small = {"fwd": [32, 32, 4, 1], "bwd_dq": [32, 16, 4, 1], "bwd_dkdv": [16, 32, 4, 1]}
        args.config = json.dumps(small | (json.loads(args.config) if args.config else {}))
    rows = report(args.heads, args.head_dim, args.mean, args.config, tokens=args.tokens)
    print(
        f"# triton_short on sm_90a, H={args.heads}, D={args.head_dim}, mean={args.mean}, config "
        f"{args.config or '{}'}"
    )
    print("| kernel | config | PackGQA | maxnreg | registers | spill stores / loads (B) | shared (KB) |"
          " programs / SM by registers | by shared memory |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['kernel']} | {tuple(r['config'])} | {r['pack_gqa']} | {r['maxnreg'] or '-'} | "
            f"{r['registers']} | "
            f"{r['spill_stores']} / {r['spill_loads']} | {r['shared'] / 1024:.1f} | {r['by_registers']} | "
            f"{r['by_shared']} |"
        )
    launched_rows = []
    if args.launched:
        launched_rows = launched(args.heads, args.head_dim, args.mean, args.config, tokens=args.tokens)
        print("\nlaunched on this GPU (Triton's compiled-kernel cache):")
        print("| kernel | warps | stages | registers | spills (B) | shared (KB) |")
        print("|---|---|---|---|---|---|")
        for r in launched_rows:
            print(
                f"| {r['kernel']} | {r['num_warps']} | {r['num_stages']} | {r['registers']} | {r['spills']} "
                "| "
                f"{r['shared'] / 1024:.1f} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "launched": launched_rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
