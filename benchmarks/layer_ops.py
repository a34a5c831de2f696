"""How many ATen ops one decoder layer dispatches per step: the host-side cost outside attention.

Every non-view ATen op of an eager step is a kernel launch on the GPU and a Python/C++ dispatch on the host.
This counts them with ``torch.profiler`` on the CPU (no GPU needed): a model with ``L`` and ``L + 1``
decoder layers runs the same one-sample pack forward (and forward + backward); the difference is one
layer's count. Attention is one sdpa call per layer here, so the count is the layer's work *outside*
attention (norms, RoPE, projections, SiLU·mul, residual adds, casts and their backward).

Run::

    python benchmarks/layer_ops.py --out layer_ops.json   # tiny-qwen3 layers (the code of Qwen3-0.6B's), x 28
    python benchmarks/layer_ops.py --small                 # the same (it is small already)

Prints a table: ops per layer (all leaf ops, and non-view ops), forward and forward + backward, and the
per-step total for ``--layers`` layers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import machine_info, markdown_table, write_json  # noqa: E402

#: ops that only re-describe memory (no kernel on the GPU)
VIEW_OPS = {
    "aten::view", "aten::as_strided", "aten::_reshape_alias", "aten::t", "aten::transpose", "aten::unsqueeze",
    "aten::expand", "aten::slice", "aten::select", "aten::detach", "aten::empty", "aten::empty_strided",
    "aten::alias", "aten::permute", "aten::squeeze", "aten::_unsafe_view", "aten::unflatten", "aten::split",
    "aten::resolve_conj", "aten::resolve_neg", "aten::lift_fresh",
}  # fmt: skip


def count_ops(model: torch.nn.Module, batch: dict, backward: bool) -> tuple[int, int]:
    """(leaf ATen ops, non-view leaf ATen ops) of one forward (+ backward) of ``model`` on ``batch``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = model(**batch)
        if backward:
            out.loss.backward()
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    leaf = [e for e in aten if not any(c.name.startswith("aten::") for c in e.cpu_children)]
    return len(leaf), sum(1 for e in leaf if e.name not in VIEW_OPS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default="tiny-qwen3", help="varpack built-in text model (tiny-qwen3, tiny-llama)"
    )
    p.add_argument("--tokens", type=int, default=60, help="tokens of the one-sample pack")
    p.add_argument("--layers", type=int, default=28, help="layers of the step the totals are scaled to")
    p.add_argument("--small", action="store_true", help="accepted for uniformity: the run is small already")
    p.add_argument("--out", default=None, help="write the rows, the command, commit and machine as JSON here")
    args = p.parse_args(argv)
    from varpack.collate import PaddingFreeCollator
    from varpack.models import load_model

    ids = list(range(1, args.tokens + 1))
    batch = PaddingFreeCollator()([[{"input_ids": ids, "labels": [-100, *ids[1:]]}]])
    batch.pop("sample_ids")
    models = [
        load_model(args.model, vocab_size=512, attn_backend="sdpa", config_overrides={"num_hidden_layers": n})
        for n in (2, 3)
    ]
    rows = []
    for backward in (False, True):
        (all2, real2), (all3, real3) = (count_ops(m, batch, backward) for m in models)
        rows.append(["forward + backward" if backward else "forward", all3 - all2, real3 - real2,
                     (real3 - real2) * args.layers])  # fmt: skip
    print(f"# ATen ops per decoder layer, {args.model}, eager, one {args.tokens}-token sample, CPU profiler")
    print(
        markdown_table(
            ["pass", "leaf ops / layer", "non-view ops / layer", f"non-view ops / {args.layers} layers"], rows
        )
    )
    write_json(args.out, {"machine": machine_info(), "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
