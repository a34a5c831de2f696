"""How much of a bf16 gradient error comes from batching alone: the vision tower of ``qwen3.5-vl-hybrid-shape`` (one
layer), no varpack code in its path, run on the built-in image chats' images once in one call (as a packed row
hands them over) and once per image (as the per-sample reference does), each against the float32 per-image truth.

``varpack check --dtype bf16`` accepts a gradient when ``err(packed) <= 2 * err(unpacked) + 0.02 * max|g|``. A
tower that is per image by construction shows what that rule makes of a longer reduction (a norm's weight
gradient sums over every patch of the call)::

    python -m benchmarks.vl_tower_bf16            # CPU, about a minute

Prints, per parameter, max|g| of the truth and the max abs error of the batched and the per-image bf16 runs.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from collections.abc import Sequence

import torch

__all__ = ["main", "tower_grads"]

PARAMS = ("blocks.0.norm1.weight", "blocks.0.norm2.weight", "merger.norm.bias", "blocks.0.attn.qkv.weight")


def tower_grads(visual, pixels, grids, dtype, batched: bool) -> dict[str, torch.Tensor]:
    """Gradients of ``sum(tower(images) * R)`` (R fixed, standard normal) w.r.t. the tower's parameters, float32."""
    tower = copy.deepcopy(visual).to(dtype)
    tower.zero_grad()
    calls = [(torch.cat(pixels), torch.cat(grids))] if batched else list(zip(pixels, grids))
    outs = []
    for pix, grid in calls:
        out = tower(pix.to(dtype), grid_thw=grid)
        outs.append(getattr(out, "pooler_output", None) if not isinstance(out, torch.Tensor) else out)
    out = torch.cat(outs).float()
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * weight).sum().backward()
    return {n: p.grad.float().clone() for n, p in tower.named_parameters() if p.grad is not None}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=3, help="image chats of the built-in set (default: %(default)s)")
    args = p.parse_args(argv)
    from varpack.data.load import load_and_encode
    from varpack.data.vl_builtin import write_vl_jsonl
    from varpack.models import load_model
    from varpack.models.load import load_tokenizer_for

    name = "qwen3.5-vl-hybrid-shape"
    model = load_model(name, config_overrides={"num_hidden_layers": 4, "vision_config": {"depth": 1}})
    with tempfile.TemporaryDirectory() as tmp:
        path = write_vl_jsonl(f"{tmp}/vl.jsonl", include_text=False, limit=args.images)
        samples = list(load_and_encode([path], load_tokenizer_for(name), rope_model=lambda: model, num_proc=1).samples)
    pixels = [torch.as_tensor(s["pixel_values"]) for s in samples]
    grids = [torch.as_tensor(s["image_grid_thw"]) for s in samples]
    visual = model.model.visual
    truth = tower_grads(visual, pixels, grids, torch.float32, batched=False)
    batched = tower_grads(visual, pixels, grids, torch.bfloat16, batched=True)
    single = tower_grads(visual, pixels, grids, torch.bfloat16, batched=False)
    print(f"images: {len(pixels)}, patches per image {[int(x.shape[0]) for x in pixels]}")
    print("| parameter | max abs grad (fp32) | bf16 err, one call | bf16 err, a call per image | ratio |")
    print("|---|---|---|---|---|")
    for n in PARAMS:
        t = truth[n]
        eb, es = (batched[n] - t).abs().max().item(), (single[n] - t).abs().max().item()
        print(f"| {n} | {t.abs().max().item():.3g} | {eb:.3g} | {es:.3g} | {eb / max(es, 1e-30):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
