"""Whose is a bf16 failure of ``varpack check`` on a vision-language model: the packing's, or the vision tower's
batching? The check runs on the same model, samples and seed, with the tower batched (as shipped) and called per
image; ``--reference varpack`` puts the per-sample reference on varpack's own kernels; ``--first-difference``
lists the modules whose output differs between a packed row and rows of one.

The check runs twice on the same model, samples and seed, on the same device:

* ``batched``: as ``varpack check`` runs it. The packed row hands every image of the row to the tower in one
  call (as transformers batches them); the per-sample reference calls the tower once per sample.
* ``per-image``: the same, except that the tower is called once per image in every run (packed, per sample and
  the fp32 truth alike), so its outputs do not depend on how images were grouped; everything else (the language
  model's packed row, its boundaries, the gated delta rule backend) is unchanged.

A gradient that fails ``batched`` and passes ``per-image`` owes its failure to the tower's longer bf16 reductions
(``benchmarks/vl_tower_bf16.py`` measures those alone); one that fails both is the language model's path.

``--reference varpack`` runs the low-precision per-sample reference on varpack's own kernels instead of the model's
attention (each sample alone as a packed row of one: the same varlen attention and gated delta rule kernels as
the packed row), so that the two low-precision runs differ only in how the samples are grouped; the fp32 truth
is unchanged. Also printed: the tower outputs' max abs error against the fp32 truth in the packed and the
per-sample run::

    python -m benchmarks.vl_check_tower --device cuda --seeds 0 1 2        # H200: about 30 s per check
    python -m benchmarks.vl_check_tower --device cuda --reference varpack  # same kernels in both runs
    python -m benchmarks.vl_check_tower --device cpu --cut                 # CPU, a 4-layer cut of the model

Exit status 0; the verdicts are in the output (one ``RESULT`` JSON line per run).
"""

from __future__ import annotations

import argparse
import json
import types
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["first_difference", "main", "per_image_tower"]

#: vision keywords transformers' helpers accept precomputed for the whole call (transformers/vision_utils.py);
#: a per-image call cannot split them, so they are refused
_WHOLE_CALL_KWARGS = frozenset(
    {"cu_seqlens", "position_ids", "window_index", "cu_window_seqlens", "interp_indices", "interp_weights",
     "bilinear_indices", "bilinear_weights", "merged_shape"}
)  # fmt: skip


def _cat(parts: list[Any]) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, (list, tuple)):
        return type(first)(_cat([p[i] for p in parts]) for i in range(len(first)))
    if first is None:
        return None
    keys = [k for k in first.keys()]  # a transformers ModelOutput
    return type(first)(**{k: _cat([p[k] for p in parts]) for k in keys})


def _per_image_forward(self: torch.nn.Module, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs):
    given = sorted(k for k, v in kwargs.items() if k in _WHOLE_CALL_KWARGS and v is not None)
    if given:
        raise ValueError(f"per-image tower: precomputed whole-call keywords {given} cannot be split per image")
    sizes = [int(n) for n in grid_thw.prod(-1).tolist()]
    chunks = hidden_states.split(sizes)
    forward = type(self).forward
    return _cat([forward(self, h, grid_thw=grid_thw[i : i + 1], **kwargs) for i, h in enumerate(chunks)])


def per_image_tower(model: torch.nn.Module) -> None:
    """Make ``model``'s vision tower run one call per image (a bound method: a deep copy keeps it)."""
    from varpack.models.registry import family_of

    tower = family_of(model).vision_tower(model)
    tower.forward = types.MethodType(_per_image_forward, tower)


def _record_tower(model: torch.nn.Module, store: list) -> None:
    from varpack.models.registry import family_of

    def hook(module, args, output):
        pooled = output if isinstance(output, torch.Tensor) else output["pooler_output"]
        store.append((pooled.dtype, pooled.detach().float().cpu()))

    family_of(model).vision_tower(model).register_forward_hook(hook)


def _tower_errors(store: list) -> dict[str, float]:
    """Tower outputs of one check: the packed run's bf16 call(s), then the per-sample bf16 calls, then the fp32
    truth's per-sample calls, in that order (check_exactness's order)."""
    low = [t for d, t in store if d != torch.float32]
    truth = torch.cat([t for d, t in store if d == torch.float32])
    total = truth.shape[0]
    packed, per_sample, seen = [], [], 0
    for t in low:  # the packed run's calls come first and cover every image once
        if seen < total:
            packed.append(t)
            seen += t.shape[0]
        else:
            per_sample.append(t)
    err = lambda parts: float((torch.cat(parts) - truth).abs().max())  # noqa: E731
    return {"tower_err_packed": err(packed), "tower_err_unpacked": err(per_sample), "tower_scale": float(truth.abs().max())}


def _per_sample_on_varpack_kernels(original):
    """``varpack.check._unpacked_run`` whose low-precision runs send each sample alone through the packed path
    (boundary keywords of a row of one, the model left on varpack attention); the fp32 truth (float32
    parameters) runs the original."""

    def run(model, collate, samples, device, attn):
        if next(model.parameters()).dtype == torch.float32:
            return original(model, collate, samples, device, attn)
        return original(model, collate, samples, device, model.config._attn_implementation, rows_of_one=True)

    return run


def _gate_failures(failures: list[str]) -> list[str]:
    return [f for f in failures if ".dt_bias" in f or ".A_log" in f]


def _model_and_rows(args: argparse.Namespace, seed: int) -> tuple[torch.nn.Module, list[dict]]:
    """The bf16 model (``--cut``: 4 language layers, 1 vision layer) and ``varpack check``'s image samples."""
    from varpack.cli.check import select_mm_samples
    from varpack.data import load_and_encode
    from varpack.models import is_vl_model, load_model, load_tokenizer_for

    overrides = {"num_hidden_layers": 4, "vision_config": {"depth": 1}} if args.cut else None
    model = load_model(args.model, dtype=torch.bfloat16, seed=seed, device=args.device, config_overrides=overrides)
    if not is_vl_model(model):
        raise ValueError(f"--model {args.model} is not a vision-language model (no vision tower to check)")
    data = load_and_encode(None, load_tokenizer_for(args.model), vl=True, rope_model=model)
    return model, select_mm_samples(data.samples, args.num_samples)


def run_one(args: argparse.Namespace, seed: int, mode: str) -> dict[str, Any]:
    from varpack.check import check_exactness

    model, rows = _model_and_rows(args, seed)
    if mode == "per-image":
        per_image_tower(model)
    store: list = []
    _record_tower(model, store)
    from varpack import check

    original = check._unpacked_run
    if args.reference == "varpack":
        check._unpacked_run = _per_sample_on_varpack_kernels(original)
    try:
        result = check_exactness(model, rows, gated_delta_backend=args.gated_delta_backend)
    finally:
        check._unpacked_run = original
    out = {
        "seed": seed,
        "tower": mode,
        "reference": args.reference,
        "passed": result["passed"],
        "gated_delta_backend": result.get("gated_delta_backend"),
        "num_tokens": result["num_tokens"],
        "failures": result["failures"],
        "gate_failures": len(_gate_failures(result["failures"])),
        **_tower_errors(store),
    }
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def _token_cat(parts: list[torch.Tensor], total: torch.Tensor) -> torch.Tensor | None:
    """The per-sample outputs of one module joined along the dimension the packed row joins them on."""
    for dim in range(total.dim()):
        rest = [s for i, s in enumerate(total.shape) if i != dim]
        if all([s for i, s in enumerate(p.shape) if i != dim] == rest for p in parts) and (
            sum(p.shape[dim] for p in parts) == total.shape[dim]
        ):
            return torch.cat(parts, dim=dim)
    return None


def first_difference(model: torch.nn.Module, rows: list[dict], device: str) -> tuple[int, list[tuple[str, float, tuple]]]:
    """Forward ``rows`` once as one packed row and once each as a packed row of one (the same varpack kernels,
    ``model`` already under :func:`varpack.integrations.transformers.enable_varpack`), record every module's
    output, and list the modules, in the packed run's call order, whose output differs between the two:
    ``(name, max abs diff, shape)``; with the number of modules compared."""
    from varpack.check import _model_inputs
    from varpack.collate import PaddingFreeCollator

    model.eval()
    record: dict[str, list[torch.Tensor]] = {}
    order: list[str] = []

    def hook(name):
        def fn(module, inputs, output):
            out = output if isinstance(output, torch.Tensor) else next(
                (o for o in (output.values() if hasattr(output, "values") else output) if isinstance(o, torch.Tensor)),
                None,
            )
            if out is not None:
                if name not in record:
                    order.append(name)
                record.setdefault(name, []).append(out.detach().clone())

        return fn

    collate = PaddingFreeCollator()
    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    try:
        model(**_model_inputs(collate([rows]), torch.device(device), packed=True))
        packed = {n: v[0] for n, v in record.items()}
        packed_order = list(order)
        record.clear()
        for row in rows:
            model(**_model_inputs(collate([[row]]), torch.device(device), packed=True))
    finally:
        for h in handles:
            h.remove()
    out, compared = [], 0
    for name in packed_order:
        total, parts = packed[name], record.get(name, [])
        if len(parts) == 1 and parts[0].shape == total.shape:  # the tower: one call in both runs when 1 image
            joined = parts[0]
        else:
            joined = _token_cat(parts, total) if parts else None
        if joined is None:
            continue
        compared += 1
        if not torch.equal(joined, total):
            out.append((name, float((joined.float() - total.float()).abs().max()), tuple(total.shape)))
    return compared, out


def main(argv: Sequence[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3.5-vl-hybrid-shape", help="a vision-language built-in (%(default)s)")
    p.add_argument("--device", default="cuda" if cuda else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="random-init seeds, one check each")
    p.add_argument("--num-samples", type=int, default=4, help="image chats of the built-in set (default: 4)")
    p.add_argument("--gated-delta-backend", default="auto", help="as varpack check's (default: auto)")
    p.add_argument(
        "--modes", nargs="+", default=["batched", "per-image"], choices=["batched", "per-image"],
        help="the tower batched (as varpack check) and/or called per image (default: both)",
    )  # fmt: skip
    p.add_argument(
        "--reference", default="model", choices=["model", "varpack"],
        help="the low-precision per-sample run: the model's own attention (as varpack check) or varpack's kernels",
    )  # fmt: skip
    p.add_argument(
        "--first-difference", action="store_true",
        help="instead of the checks: forward only, list the modules whose output differs between the packed "
        "row and rows of one (both on varpack's kernels; --modes and --reference do not apply)",
    )  # fmt: skip
    p.add_argument("--cut", action="store_true", help="4 language layers and 1 vision layer (a CPU-sized model)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not cuda:
        p.error("--device cuda but CUDA is not available here")
    if args.num_samples < 1:
        p.error(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.first_difference and (args.reference != "model" or args.modes != ["batched", "per-image"]):
        p.error("--first-difference runs no check: --modes and --reference do not apply")
    try:
        return _run(args)
    except ValueError as exc:  # a text-only model, an unknown backend or model name: varpack's own message
        p.error(str(exc))


def _run(args: argparse.Namespace) -> int:
    if args.first_difference:
        for seed in args.seeds:
            model, rows = _model_and_rows(args, seed)
            from varpack.integrations.transformers import enable_varpack

            enable_varpack(model, linear_backend=args.gated_delta_backend)
            model.eval()
            compared, diffs = first_difference(model, rows, args.device)
            print(
                f"seed {seed}: {len(diffs)} of {compared} module outputs differ between the packed row and rows of "
                "one" + ("; the first 12 in call order:" if diffs else "")
            )
            for name, diff, shape in diffs[:12]:
                print(f"    {name} {shape}: max abs diff {diff:.3g}")
        return 0
    for seed in args.seeds:
        for mode in args.modes:
            r = run_one(args, seed, mode)
            verdict = "PASS" if r["passed"] else f"FAIL ({len(r['failures'])}, {r['gate_failures']} dt_bias/A_log)"
            print(
                f"seed {seed} tower {mode:9s} reference {args.reference}: {verdict}; tower output err vs fp32 packed {r['tower_err_packed']:.3g}"
                f" / per sample {r['tower_err_unpacked']:.3g} (max |out| {r['tower_scale']:.3g})"
            )
            for f in r["failures"]:
                print(f"    - {f}")
            print("RESULT " + json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
