"""``varpack check``: prove on a model that a packed step equals the unpacked step.

    varpack check [--model DIR|tiny-qwen3|...] [--data PATH...] [--attn-backend auto|reference|...]
                  [--gated-delta-backend auto|fla|fla_hybrid|chunk|chunk_compiled|naive]
                  [--dtype fp32|bf16|fp16] [--device cpu|cuda] [--num-samples N] [--max-sample-length L]
                  [--seed S] [--context-parallel N] [--context-parallel-attention auto|ulysses|ring] [--json]
    varpack check --zoo [--zoo-type TYPE ...] [--write docs/MODELS.md] [--json]

Encodes chat data (default: the built-in chats; for a vision-language model the built-in image-caption
chats) with the model's tokenizer, takes the first ``--num-samples`` conversations (each cut to
``--max-sample-length`` tokens; image chats are never cut), runs them packed in one
padding-free row (varpack attention) and one by one (the model's own attention), and prints max |logit
diff|, the two losses and max |grad diff| with PASS / FAIL (:func:`varpack.check.check_exactness`). For a
model with Gated DeltaNet layers (Qwen3.5, Qwen3-Next) it prints the gated delta rule backend of the packed run
and why (``auto``'s probes, or ``forced`` by ``--gated-delta-backend``). Exit status 0 on PASS, 1 on FAIL or
an error (bad data, unknown model, no CUDA; a ``--gated-delta-backend`` that cannot run on the device, with
its reason, or given for a model without Gated DeltaNet layers), 2 on a usage error. With ``--json`` stdout
carries exactly one JSON object. ``--dtype`` also takes torch's spellings (``float32``, ``bfloat16``,
``float16``), as ``varpack sft`` does.

``--context-parallel N`` (under ``torchrun --nproc-per-node N``, or a multiple of N) runs the packed row split
over groups of N ranks (:mod:`varpack.integrations.context_parallel`): the group's logits are gathered, its loss
and gradients summed, and compared with the one-process unpacked run as without it; rank 0 prints, every rank
exits with the verdict.

``--zoo`` runs the model zoo instead (:mod:`varpack.zoo`): every causal-LM model type of the installed
transformers (or the ``--zoo-type`` ones) as a tiny random-init model on the CPU, one line per type (status,
family, token mixers, reason); ``--write PATH`` writes the matrix (docs/MODELS.md). Exit 1 when a type lands in
no state (inexact without a refusal, or exact without a family: the message says what to change).

A flag read only with another (``--write`` with ``--zoo``, ``--context-parallel-attention`` with
``--context-parallel N``, :data:`DEPENDENT_FLAGS`) given without it is a usage error (exit 2), never ignored.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from varpack.cli._common import (
    ATTN_BACKENDS,
    DTYPE_SPELLINGS,
    GATED_DELTA_BACKENDS,
    UsageError,
    check_data_files,
    dtype_spelling,
    int_at_least,
)

__all__ = ["DEPENDENT_FLAGS", "refuse_unread_flags", "register", "run"]

#: Flags read only with another: ``dest`` -> (its default, the flag it needs, whether ``args`` has that). Given
#: a value other than its default without what it needs, a flag is refused (exit 2) naming both, never ignored.
DEPENDENT_FLAGS: dict[str, tuple[Any, str, Callable[[argparse.Namespace], bool]]] = {
    "context_parallel_attention": ("auto", "--context-parallel N, N >= 2", lambda a: a.context_parallel > 1),
    "write": (None, "--zoo", lambda a: bool(a.zoo or a.zoo_types)),
}


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``check`` sub-command to ``subparsers`` and return its parser."""
    p = subparsers.add_parser(
        "check",
        help="check that packed == unpacked (logits, loss, gradients) on a model",
        description=(
            "Run real samples packed (padding-free, varpack attention) and one by one (the model's own "
            "attention); compare logits, loss and every gradient. Exit 1 on FAIL."
        ),
    )
    p.add_argument(
        "--model",
        default="tiny-qwen3",
        metavar="DIR|NAME",
        help="model directory, .gguf file / package, or a built-in name (default: tiny-qwen3)",
    )
    p.add_argument(
        "--data",
        nargs="+",
        action="extend",  # --data a --data b: both
        default=None,
        metavar="PATH",
        help="chat data files (default: the built-in chats; image-caption chats for a vision-language model)",
    )
    p.add_argument(
        "--attn-backend",
        dest="attn_backend",
        choices=ATTN_BACKENDS,
        default="auto",
        help="varpack attention backend (default: %(default)s)",
    )
    p.add_argument(
        "--gated-delta-backend",
        dest="gated_delta_backend",
        choices=GATED_DELTA_BACKENDS,
        default="auto",
        help=(
            "gated delta rule backend of the linear-attention layers of Qwen3.5 / Qwen3-Next models in the "
            "packed run. auto: fla, else fla_hybrid on CUDA when their probes pass, else chunk; a forced one "
            "that cannot run on --device is an error with its reason; refused for a model without such layers "
            "(default: %(default)s)"
        ),
    )
    p.add_argument(
        "--dtype",
        type=dtype_spelling(short=True),
        choices=sorted(DTYPE_SPELLINGS),
        default="fp32",
        help="dtype of the run; also float32, bfloat16, float16, as varpack sft spells them (default: %(default)s)",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--num-samples",
        dest="num_samples",
        type=int_at_least(1),
        default=4,
        metavar="N",
        help="samples to pack (default: %(default)s)",
    )
    p.add_argument(
        "--max-sample-length",
        dest="max_sample_length",
        type=int_at_least(0),
        default=128,
        metavar="L",
        help="cut each sample to this many tokens; 0: no cut (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int_at_least(0),
        default=0,
        metavar="S",
        help="random-init seed of built-in models (default: %(default)s)",
    )
    p.add_argument(
        "--context-parallel",
        dest="context_parallel",
        type=int_at_least(1),
        default=1,
        metavar="N",
        help=(
            "split the packed row over groups of N ranks (run under torchrun --nproc-per-node N or a multiple "
            "of N); 1: one process (default: %(default)s)"
        ),
    )
    p.add_argument(
        "--context-parallel-attention",
        dest="context_parallel_attention",
        choices=("auto", "ulysses", "ring"),
        default="auto",
        help=(
            "with --context-parallel: ulysses (all-to-all to head shards), ring (key/value blocks round the "
            "ring, log-sum-exp merge) or auto (ulysses where the heads divide N, else ring) (default: %(default)s)"
        ),
    )
    p.add_argument("--atol", type=float, default=None, help="override the logit tolerance (see docs)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument(
        "--zoo",
        action="store_true",
        help="run the model zoo: every causal-LM model type of the installed transformers, tiny, on the CPU",
    )
    p.add_argument(
        "--zoo-type",
        dest="zoo_types",
        nargs="+",
        default=None,
        metavar="TYPE",
        help="with --zoo: only these model types (transformers' spelling: llama, gpt_oss, deepseek_v3, ...)",
    )
    p.add_argument(
        "--write", default=None, metavar="PATH", help="with --zoo: write the matrix (docs/MODELS.md) to PATH"
    )
    return p


def select_samples(encoded: Any, num_samples: int, max_length: int) -> list[dict[str, Any]]:
    """The first ``num_samples`` encoded samples as dicts, each cut to ``max_length`` tokens (0: uncut).

    Raises:
        ValueError: ``num_samples < 1`` or more than the data holds.
    """
    if num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {num_samples}")
    if num_samples > len(encoded):
        raise ValueError(f"--num-samples {num_samples} but the data has only {len(encoded)} samples")
    rows = []
    for i in range(num_samples):
        row = encoded[i]
        ids, labels = list(row["input_ids"]), list(row["labels"])
        if max_length and len(ids) > max_length:
            ids, labels = ids[:max_length], labels[:max_length]
        rows.append({"input_ids": ids, "labels": labels, "sample_id": row.get("sample_id", i)})
    return rows


def select_mm_samples(encoded: list[dict[str, Any]], num_samples: int) -> list[dict[str, Any]]:
    """The first ``num_samples`` samples of image/video chats, whole (a cut could split an image's
    placeholder span; ``--max-sample-length`` does not apply), with every field (media, mRoPE positions).

    Raises:
        ValueError: ``num_samples < 1`` or more than the data holds.
    """
    if num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {num_samples}")
    if num_samples > len(encoded):
        raise ValueError(f"--num-samples {num_samples} but the data has only {len(encoded)} samples")
    return [dict(encoded[i]) for i in range(num_samples)]


def run_zoo(args: argparse.Namespace) -> int:
    """``varpack check --zoo``: 0 when every model type is exact, refused or not applicable, 1 otherwise."""
    from varpack.zoo import ZooError, as_dict, render_matrix, run_zoo, zoo_model_types

    if args.zoo_types and args.write:
        raise ValueError("--write writes the whole matrix: run --zoo without --zoo-type")
    types = args.zoo_types
    if types:
        known = set(zoo_model_types())
        from transformers import CONFIG_MAPPING

        unknown = [t for t in types if t not in known and t not in CONFIG_MAPPING]
        if unknown:
            raise ValueError(f"--zoo-type: unknown model type(s) {unknown} for transformers' CONFIG_MAPPING")

    def show(r: Any) -> None:
        if not args.json:
            print(f"{r.model_type:28s} {r.status:15s} {r.family:16s} {r.mixers}  {r.reason}".rstrip(), flush=True)

    try:
        results = run_zoo(types, progress=show)
    except ZooError as exc:
        print(f"varpack check --zoo: {exc}", file=sys.stderr)
        return 1
    counts = {s: sum(r.status == s for r in results) for s in ("exact", "refused", "not applicable")}
    if args.json:
        json.dump({"results": [as_dict(r) for r in results], "counts": counts}, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(f"{len(results)} model types: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    if args.write:
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(render_matrix(results))
        if not args.json:
            print(f"wrote {args.write}")
    return 0


def refuse_unread_flags(args: argparse.Namespace) -> None:
    """Refuse a flag of :data:`DEPENDENT_FLAGS` given without the flag it needs.

    Raises:
        UsageError: ``--write has an invalid value: PATH (needs --zoo)``, ``--context-parallel-attention has an
            invalid value: ring (needs --context-parallel N, N >= 2)``.
    """
    for dest, (default, needed, on) in DEPENDENT_FLAGS.items():
        value = getattr(args, dest)
        if value != default and not on(args):
            raise UsageError(f"--{dest.replace('_', '-')} has an invalid value: {value} (needs {needed})")


def run(args: argparse.Namespace) -> int:
    """Run ``varpack check``: 0 on PASS, 1 on FAIL; errors propagate to ``varpack.cli.main`` (exit 1; a flag
    given without the flag it needs, :func:`refuse_unread_flags`: exit 2)."""
    refuse_unread_flags(args)
    if args.zoo or args.zoo_types:
        return run_zoo(args)
    check_data_files(args.data)  # a missing file is reported before torch and transformers are imported
    import torch

    opened = _init_process_group(args.context_parallel) if args.context_parallel > 1 else False
    try:
        return _run(args, torch)
    finally:
        if opened:
            from varpack.train.distributed import close_process_group

            close_process_group()


def _init_process_group(cp: int) -> bool:
    """The process group torchrun describes (gloo on CPUs, NCCL on GPUs), opened unless it is open already
    (returns whether this call opened it); refused without torchrun."""
    import os

    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % cp or world < cp:
        raise ValueError(
            f"--context-parallel {cp} needs a multiple of {cp} processes, got {world}: run it under torchrun "
            f"--nproc-per-node {cp}"
        )
    if dist.is_initialized():
        return False
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    return True


def _run(args: argparse.Namespace, torch: Any) -> int:
    from varpack.check import check_exactness
    from varpack.data import load_and_encode
    from varpack.models import is_vl_model, load_model, load_tokenizer_for

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.context_parallel > 1 and device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"  # this rank's GPU (torchrun's LOCAL_RANK)
    try:
        device_type = torch.device(device).type
    except RuntimeError as exc:  # torch's own message lists the device types
        raise ValueError(f"--device {device!r} is not a device: {exc}") from exc
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device} but CUDA is not available here")
    dtype = getattr(torch, DTYPE_SPELLINGS[args.dtype])
    tokenizer = load_tokenizer_for(args.model)
    # the model comes first: image chats are encoded with its own mRoPE function and patch grid
    model = load_model(
        args.model,
        dtype=dtype,
        seed=args.seed,
        attn_backend=args.attn_backend,
        device=device,
        gated_delta_backend=args.gated_delta_backend,  # refused here for a model without Gated DeltaNet layers
    )
    # a forced gated delta rule backend that cannot run on the device: refused before the data is encoded
    _refuse_unrunnable_gated_delta_backend(model, device, args.gated_delta_backend)
    # a VL model without --data is checked on images: the built-in image-caption chats
    data = load_and_encode(args.data, tokenizer, vl=is_vl_model(model), rope_model=model)
    if data.multimodal:
        rows = select_mm_samples(data.samples, args.num_samples)
    else:
        rows = select_samples(data.samples, args.num_samples, args.max_sample_length)
    result = check_exactness(
        model,
        rows,
        backend=args.attn_backend,
        atol=args.atol,
        gated_delta_backend=args.gated_delta_backend,
        context_parallel=args.context_parallel,
        context_parallel_attention=args.context_parallel_attention,
    )
    result["samples_with_media"] = sum(1 for r in rows if "pixel_values" in r or "pixel_values_videos" in r)
    result["model"] = args.model
    result["device"] = str(device)
    if args.context_parallel > 1 and torch.distributed.get_rank() != 0:
        return 0 if result["passed"] else 1  # rank 0 prints the group's verdict
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    else:
        _print_table(result, type(model).__name__, sum(p.numel() for p in model.parameters()))
    return 0 if result["passed"] else 1


def _refuse_unrunnable_gated_delta_backend(model: Any, device: str, requested: str) -> None:
    """A forced ``--gated-delta-backend`` that cannot run on ``device``: an error with its reason (exit 1)."""
    from varpack.integrations.gated_delta import linear_attention_backend

    try:
        linear_attention_backend(model, device, needs_grad=True)
    except RuntimeError as exc:  # resolve_backend's refusal, with the reason
        raise ValueError(f"--gated-delta-backend {requested}: {exc}") from exc


def _print_table(r: dict[str, Any], model_class: str, num_params: int) -> None:
    print(
        f"varpack check: {r['model']} ({model_class}, {num_params / 1e6:.1f}M params), {r['num_samples']} "
        f"samples ({r.get('samples_with_media', 0)} with images/video), {r['num_tokens']} tokens in one "
        f"packed row, {r['dtype']} on {r['device']}"
    )
    print(
        f"attention backend: {r['backend']} ({r['backend_reason']}); unpacked reference: {r['reference_attn']}"
    )
    if "context_parallel" in r:
        layers = "; ".join(f"{k}: {v}" for k, v in r["context_parallel_plan"].items())
        print(f"context parallel: the row split over {r['context_parallel']} ranks (zigzag; {layers})")
    if "gated_delta_backend" in r:
        why = r["gated_delta_reason"]
        if why == "forced":
            why = f"forced: --gated-delta-backend {r['gated_delta_backend']}"
        print(f"gated delta rule backend: {r['gated_delta_backend']} ({why})")
    loss_diff = abs(r["loss_packed"] - r["loss_unpacked"])
    print(f"  max |logit diff|  {r['max_abs_logit_diff']:.3e}")
    print(f"  loss packed       {r['loss_packed']:.6f}")
    print(f"  loss unpacked     {r['loss_unpacked']:.6f}   |diff| {loss_diff:.3e}")
    print(f"  max |grad diff|   {r['max_abs_grad_diff']:.3e}   (worst: {r['worst_grad_param']})")
    if "logit_err_packed" in r:
        print(
            f"  vs fp32 truth     logits {r['logit_err_packed']:.3e} packed / {r['logit_err_unpacked']:.3e} "
            f"unpacked; grads {r['grad_err_packed']:.3e} / {r['grad_err_unpacked']:.3e}"
        )
    print(f"  tolerance         {r['tolerance']}")
    if r["passed"]:
        print("PASS")
    else:
        print("FAIL")
        for failure in r["failures"][:10]:
            print(f"  - {failure}")
        if len(r["failures"]) > 10:
            print(f"  ... and {len(r['failures']) - 10} more")
        if r.get("note"):
            print(f"  note: {r['note']}")
