"""``check_exactness``: prove on a given model that a packed step equals the unpacked step.

The samples are packed into ONE padding-free row with :class:`varpack.collate.PaddingFreeCollator` and run
through varpack attention (the *packed* run); then each sample runs alone through the model's own attention
(sdpa / eager, no boundary kwargs: the *unpacked* run). Both runs compute the token-mean causal-LM loss over
all samples (:func:`varpack.loss.causal_lm_loss`) and its gradient w.r.t. every parameter. Compared:

* ``max_abs_logit_diff``: max |logit difference| over every real token of every sample;
* ``loss_packed`` / ``loss_unpacked``;
* ``max_abs_grad_diff``: max |gradient difference| over every element of every parameter.

Pass rule:

* float32: ``max_abs_logit_diff <= atol + 1e-5 * max|logit|`` (atol default 1e-4: fp32 GEMMs over a packed
  row and over one sample round differently), ``|loss diff| <= 1e-5 * max(1, |loss|)``, and per parameter
  ``|g_packed - g_unpacked| <= 1e-7 + 1e-3 * max|g_unpacked|`` (the absolute term a tenth of the ~1e-6 gradients of
  a Gated DeltaNet layer's gate parameters, so a leak confined to them is seen);
* bfloat16 / float16 (the fp32-truth rule, as in flash-attn's tests): an fp32 copy of the model runs unpacked
  (the truth); the packed low-precision run must be as close to the truth as the unpacked low-precision run
  is, within a factor 2 plus a small ``atol``: ``err(packed) <= 2 * err(unpacked) + atol``, for the logits,
  the loss and every parameter's gradient (max abs error each). Low-precision noise is then never mistaken
  for a leak, and a leak (errors of order 0.1-1) is never mistaken for noise.

A model whose boundaries were sabotaged (e.g. one segment over the whole row) fails this check, and so does a
leak confined to the backward of the small-gradient gate parameters of a Gated DeltaNet layer (tested): a
gradient's ``atol`` stays relative to its own ``max|g|``. Known limit of that choice: a gradient that is a
cancelling sum over tokens (a Gated DeltaNet ``A_log``, ~1e-6 of the embedding's) can fail an honest
low-precision run on its noise (tiny-qwen3.5, bf16, CPU, one sample set of the tests; qwen3.5-vl-hybrid-shape,
bf16, H200, where a one-ulp difference of the vision merger's GEMM over the packed row is amplified there,
benchmarks/RESULTS.md); such a failure carries ``result["note"]``. A run in fp32 (``--dtype fp32``, where
such noise is ~1e-9) tells noise from a leak; on CUDA with ``gated_delta_backend="chunk"``, since fla's
kernels take fp32 dots in TF32 (~1e-3 relative, the fp32 rule's own size).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from varpack.schema import (
    BOUNDARY_KEYS,
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    IGNORE_INDEX,
    LABELS,
    NOT_MODEL_INPUTS,
    SHIFT_LABELS,
    SHIFT_LOSS_SCALE,
)

__all__ = ["check_exactness"]

_LOW_PRECISION_ATOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}
#: float32 rule, absolute term of a gradient's bound: honest packed runs of the tiny Gated DeltaNet models differ
#: by <= 2e-9 on gate gradients of max|g| ~1e-6, fla_hybrid's pipeline (CPU stand-ins) by <= 4e-8 on A_log;
#: 1e-4 (the earlier term) let a backward-only leak of ~1e-6 in them pass (tests/test_check.py)
FP32_GRAD_ATOL = 1e-7

#: leaf names of a Gated DeltaNet layer's gate parameters (``g = -exp(A_log) * softplus(a + dt_bias)``): each
#: gradient is a sum over every token of the row whose terms cancel
GATE_PARAMETERS = ("dt_bias", "A_log")

#: ``result["note"]`` of a low-precision check whose every failure is a gate parameter's gradient
GATE_NOISE_NOTE = (
    "the FAIL stands, but every failing gradient belongs to a Gated DeltaNet gate parameter (dt_bias / A_log). "
    "Each is a sum over all tokens whose terms cancel, so tiny rounding differences elsewhere (a matrix multiply "
    "over the packed row rounds differently from one over a single sample) are magnified there, and in {dtype} "
    "that noise looks like a leak in the gate's backward. To decide, rerun the same command with --dtype fp32 "
    "(on CUDA also with --gated-delta-backend chunk: fla's kernels compute float32 products in TF32); a pass "
    "there means no leak"
)


def _as_sample_list(samples: Any) -> list[dict[str, Any]]:
    if isinstance(samples, Mapping):
        raise TypeError("samples must be a sequence of encoded samples (dicts), got one dict")
    out = []
    for i, s in enumerate(samples):
        if not isinstance(s, Mapping):
            raise TypeError(f"sample {i} is a {type(s).__name__}, expected a dict with input_ids and labels")
        row = dict(s)
        row.setdefault("sample_id", i)
        out.append(row)
    if not out:
        raise ValueError("check_exactness needs at least one sample")
    return out


def _model_inputs(batch: Mapping[str, Any], device: torch.device, *, packed: bool) -> dict[str, Any]:
    out = {}
    for key, value in batch.items():
        if key in NOT_MODEL_INPUTS or (not packed and key in BOUNDARY_KEYS):
            continue
        if isinstance(value, torch.Tensor) and key not in (CU_SEQ_LENS_Q, CU_SEQ_LENS_K):
            value = value.to(device)  # boundaries stay on the CPU: varlen_attention copies them once
        out[key] = value
    return out


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (
            p.grad.detach().float().clone()
            if p.grad is not None
            else torch.zeros_like(p, dtype=torch.float32)
        )
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def _packed_run(model: Any, collate: Any, samples: list[dict], device: torch.device) -> tuple:
    from varpack.loss import causal_lm_loss

    batch = collate([samples])
    model.zero_grad(set_to_none=True)
    logits = model(**_model_inputs(batch, device, packed=True)).logits
    loss = causal_lm_loss(logits, batch["labels"].to(device), seq_idx=batch["seq_idx"].to(device))
    loss.backward()
    return logits[0].detach().float(), loss.detach().float(), _grads(model)


def _context_parallel_run(model: Any, collate: Any, samples: list[dict], device: torch.device, state: Any) -> tuple:
    """The packed step of one row split over the context-parallel group of ``state``: this rank's shard
    (:func:`varpack.collate.shard_batch`), the loss against the targets shifted before the split divided by the
    row's supervised tokens (summed over the group), then the group's pieces put together: the whole row's
    logits (gathered, each rank's tokens at their row positions), the loss and every gradient (summed)."""
    import torch.distributed as dist

    from varpack.collate import shard_batch
    from varpack.loss import shifted_lm_loss

    batch = collate([samples])
    shard = shard_batch(batch, state.rank, state.size)
    model.zero_grad(set_to_none=True)
    logits = model(**_model_inputs(shard, device, packed=True)).logits
    targets = shard[SHIFT_LABELS].to(device)
    count = (targets != IGNORE_INDEX).sum()
    dist.all_reduce(count, group=state.group)
    scale = shard.get(SHIFT_LOSS_SCALE)
    loss = shifted_lm_loss(
        logits, targets, num_items_in_batch=count, loss_scale=None if scale is None else scale.to(device)
    )
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=state.group)
    grads = _grads(model)
    for g in grads.values():
        dist.all_reduce(g, group=state.group)
    split = shard["cp_shard"]
    local = logits[0].detach().float()
    width = max(split.counts)
    padded = local.new_zeros(width, local.shape[-1])
    padded[: local.shape[0]] = local
    pieces = [torch.empty_like(padded) for _ in range(split.size)]
    dist.all_gather(pieces, padded, group=state.group)
    whole = local.new_zeros(split.total, local.shape[-1])
    for r, piece in enumerate(pieces):
        whole[split.rank_index(r).to(whole.device)] = piece[: split.counts[r]]
    return whole, total.float(), grads


def _unpacked_run(
    model: Any, collate: Any, samples: list[dict], device: torch.device, attn: str, *, rows_of_one: bool = False
) -> tuple:
    """Each sample alone through ``attn``; ``rows_of_one``: with its boundary keywords (a packed row of one
    sample, varpack's kernels), for diagnostics that compare kernels alike on both sides."""
    from varpack.loss import causal_lm_loss

    current = model.config._attn_implementation
    model.set_attn_implementation(attn)
    try:
        model.zero_grad(set_to_none=True)
        batches = [collate([[s]]) for s in samples]
        count = sum(int((b[LABELS][0, 1:] != IGNORE_INDEX).sum()) for b in batches)
        logits_all, total = [], None
        for batch in batches:
            logits = model(**_model_inputs(batch, device, packed=rows_of_one)).logits
            part = causal_lm_loss(logits, batch["labels"].to(device), num_items_in_batch=1)  # per-sample sum
            total = part if total is None else total + part
            logits_all.append(logits[0].detach().float())
        loss = total / max(count, 1)
        loss.backward()
        return torch.cat(logits_all), loss.detach().float(), _grads(model)
    finally:
        model.set_attn_implementation(current)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def _resolved_backend(
    model: Any, backend: str, device: torch.device, dtype: torch.dtype, max_seqlen: int | None = None
) -> tuple[str, str]:
    """Which backend a full-attention layer of this model runs for a pack whose longest sample has
    ``max_seqlen`` tokens, and why (varpack.attn.resolve_backend: auto's order depends on the shape class)."""
    from varpack.attn import resolve_backend
    from varpack.models.registry import family_of

    cfg = family_of(model).text_config(model)
    if not _config_value(cfg, "num_attention_heads"):  # a pure state-space model (Mamba-2): no attention layer
        return "none", "the model has no attention layers"
    heads = int(cfg.num_attention_heads)
    kv_heads = int(_config_value(cfg, "num_key_value_heads") or heads)
    head_dim = int(_config_value(cfg, "head_dim") or cfg.hidden_size // heads)
    head_dim_v = head_dim
    if _config_value(cfg, "kv_lora_rank"):  # MLA: q/k head dim = no-RoPE + RoPE parts, values their own
        head_dim = int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim)
        head_dim_v = int(cfg.v_head_dim)
        kv_heads = heads
    sinks = next((p for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] == "sinks"), None)
    q = torch.empty(1, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.empty(1, kv_heads, head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.empty(1, kv_heads, head_dim_v, device=device, dtype=dtype, requires_grad=True)
    softcap = float(_config_value(cfg, "attn_logit_softcapping") or 0.0)
    resolved = resolve_backend(
        backend, q, k, v, causal=True, softcap=softcap, max_seqlen=max_seqlen,
        sinks=None if sinks is None else sinks.detach().to(device),
    )  # fmt: skip
    return str(resolved), resolved.reason


def _config_value(config: Any, name: str) -> Any:
    """``config.<name>``, or None where it is absent or differs per layer (transformers raises on reading such
    a field globally, e.g. Gemma 4's ``head_dim``)."""
    try:
        return getattr(config, name, None)
    except Exception:  # AmbiguousGlobalPerLayerAttributeError and the like
        return None


def _gated_delta_backend(model: Any, device: torch.device, requested: str) -> tuple[str, str] | None:
    """The gated delta rule backend the model's Gated DeltaNet layers run (and why), ``None`` without any;
    a forced one that cannot run on ``device`` is refused up front (ValueError naming ``gated_delta_backend``)."""
    from varpack.integrations.gated_delta import linear_attention_backend

    try:
        return linear_attention_backend(model, device, needs_grad=True)
    except RuntimeError as exc:  # resolve_backend's refusal of a forced backend, with its reason
        raise ValueError(f"gated_delta_backend={requested!r}: {exc}") from exc


#: gated delta rule backend of the fp32 truth run of a Gated DeltaNet model on CUDA: varpack's PyTorch chunked
#: path (fp32 matmuls, equal to the token-by-token recurrence to fp32 rounding, tested), not the kernels under
#: test. transformers' own forward on CUDA calls fla's Triton kernels when fla is installed (and where fla's
#: backward is refused, varpack's path with the checked backend, fla_hybrid): fp32 dots in TF32 (Triton's
#: default input precision for fp32), a weaker truth, and a second autotuning of every fla kernel for fp32
#: (minutes on an H200). On the CPU the truth is transformers' own PyTorch reference forward, as before
#: (independent of varpack's code). :func:`varpack.integrations.gated_delta._truth_via_varpack` routes it.
TRUTH_GATED_DELTA_BACKEND = "chunk"


def _truth_gated_delta(fp32_model: Any, requested: str) -> str:
    """Set the fp32 truth copy's Gated DeltaNet layers to :data:`TRUTH_GATED_DELTA_BACKEND` (``naive`` stays
    ``naive``: the recurrence itself) and mark them as the truth (their unpacked rows then run varpack's path
    on CUDA); returns the backend set."""
    from varpack.integrations.gated_delta import patch_linear_attention
    from varpack.models.registry import is_gated_delta_layer

    backend = "naive" if requested == "naive" else TRUTH_GATED_DELTA_BACKEND
    patch_linear_attention(fp32_model, backend=backend)
    for module in fp32_model.modules():
        if is_gated_delta_layer(module):
            module._varpack_gdn_truth = True
    return backend


#: ``result["note"]`` of a failed float32 check on CUDA whose Gated DeltaNet layers ran fla's kernels
TF32_NOTE = (
    "this FAIL may be rounding, not a leak: the gated delta rule ran {backend}, whose Triton kernels compute "
    "float32 products in TF32 (about 1e-3 relative error, as large as this check's float32 tolerance of "
    "1e-3 * max|g|). To decide, rerun with --gated-delta-backend chunk (true float32 on every device), and check "
    "the {backend} kernels themselves with --dtype bf16, the precision they train in"
)


def _fla_rule_on_cuda(dtype: torch.dtype, device: torch.device, gdn: tuple[str, str] | None) -> str | None:
    """The fla-based gated delta rule backend of a float32 run on CUDA (its dots in TF32), else ``None``."""
    if dtype != torch.float32 or device.type != "cuda" or gdn is None:
        return None
    return gdn[0] if gdn[0] in ("fla", "fla_hybrid") else None


def _gate_parameter_names(model: Any) -> set[str]:
    """Qualified names of the :data:`GATE_PARAMETERS` of ``model``'s Gated DeltaNet layers."""
    from varpack.models.registry import is_gated_delta_layer

    names = set()
    for prefix, module in model.named_modules():
        if is_gated_delta_layer(module):
            for leaf in GATE_PARAMETERS:
                if isinstance(getattr(module, leaf, None), torch.nn.Parameter):
                    names.add(f"{prefix}.{leaf}" if prefix else leaf)
    return names


def _enable_context_parallel(model: Any, context_parallel: Any, attention: str) -> Any:
    """The model's :class:`~varpack.integrations.context_parallel.ContextParallelState` for ``context_parallel``
    (``None`` for one process)."""
    if context_parallel is None or (isinstance(context_parallel, int) and context_parallel == 1):
        return None
    from varpack.integrations.context_parallel import (
        context_parallel_mesh,
        enable_context_parallel,
        model_context_parallel,
    )

    group = context_parallel
    if isinstance(context_parallel, int):
        if context_parallel < 1:
            raise ValueError(f"context_parallel must be >= 1, got {context_parallel}")
        device = next(model.parameters()).device
        group = context_parallel_mesh(context_parallel, device.type)
    enable_context_parallel(model, group, attention=attention)
    return model_context_parallel(model)


def check_exactness(
    model: Any,
    samples: Sequence[Mapping[str, Any]],
    *,
    backend: str = "auto",
    dtype: torch.dtype | None = None,
    atol: float | None = None,
    reference_attn: str | None = None,
    gated_delta_backend: str = "auto",
    context_parallel: Any = None,
    context_parallel_attention: str = "auto",
) -> dict[str, Any]:
    """Run ``samples`` packed (varpack attention, one row) and one by one (the model's own attention) and
    compare logits, loss and every parameter's gradient.

    Args:
        model: a transformers causal LM (:func:`varpack.integrations.transformers.enable_varpack` is applied
            with ``backend``; the model is left on varpack attention, in its original train/eval mode, with
            its gradients cleared).
        samples: encoded samples (dicts with ``input_ids`` and ``labels``, ``labels[0] == -100``; optional
            ``position_ids``, ``loss_scale``, ...), e.g. rows of :func:`varpack.data.chat.encode_dataset`.
        backend: varpack attention backend for the packed run.
        dtype: run in this dtype (a copy of the model is cast when it differs); default: the model's dtype.
        atol: absolute term of the logit tolerance (float32; default 1e-4, plus 1e-5 * max|logit|) or the
            additive term of the fp32-truth rule (bf16 default 2e-2, fp16 2e-3).
        reference_attn: attention implementation of the unpacked run; default the model's own from before
            :func:`enable_varpack` (``sdpa`` for most models, ``eager`` where sdpa is unsupported).
        gated_delta_backend: gated delta rule backend of the packed run's linear-attention layers (Qwen3.5 /
            Qwen3-Next): ``"auto"`` or a name of :data:`varpack.ops.gated_delta_rule.BACKENDS` (``fla``,
            ``fla_hybrid``, ``chunk``, ``chunk_compiled``, ``naive``); set on the layers by
            ``enable_varpack(linear_backend=...)`` (replacing what the model had) and checked against the device
            before anything runs. The unpacked reference runs the model's own forward (varpack's path where
            that forward cannot train: fla's backward refused); the fp32 truth on CUDA runs
            :data:`TRUTH_GATED_DELTA_BACKEND`, not the kernels under test.
        context_parallel: run the packed row split over a context-parallel group (``torch.distributed``
            initialized; every rank of the group calls this with the same samples): an int ``N`` (the
            ``("dp", "cp")`` mesh of :func:`varpack.integrations.context_parallel.context_parallel_mesh`: groups
            of ``N`` consecutive ranks; more ranks check the same samples as replicas), a ``ProcessGroup`` or a
            ``DeviceMesh``; ``None`` / ``1``: one process. The group's logits are gathered, its loss and
            gradients summed, then compared with the one-process unpacked run as without it.
        context_parallel_attention: ``auto``, ``ulysses`` or ``ring``
            (:func:`varpack.integrations.context_parallel.enable_context_parallel`).

    Returns:
        dict with ``max_abs_logit_diff``, ``loss_packed``, ``loss_unpacked``, ``max_abs_grad_diff``,
        ``backend`` (what ``auto`` resolved to), ``backend_reason``, ``passed`` (bool), ``failures`` (list of
        the violated criteria), ``dtype``, ``num_samples``, ``num_tokens``, ``num_params``,
        ``worst_grad_param``, ``tolerance``; for bf16/fp16 also ``logit_err_packed`` / ``logit_err_unpacked``
        (vs the fp32 truth), ``loss_err_*`` and ``grad_err_*``, and ``note`` (:data:`GATE_NOISE_NOTE`) when
        every failure is a Gated DeltaNet gate parameter's gradient (the verdict stays a failure); a failed
        float32 run on CUDA whose Gated DeltaNet layers ran fla's kernels (TF32 dots) carries
        :data:`TF32_NOTE` as ``note``; for a model with Gated DeltaNet layers also
        ``gated_delta_backend`` / ``gated_delta_reason`` (the rule's backend for training, and why: the fla
        and fla_hybrid probes on CUDA; ``"forced"`` for a forced one); with context parallelism also
        ``context_parallel`` (the group size) and ``context_parallel_plan`` (what each layer kind runs).

    Raises:
        TypeError / ValueError: malformed samples (the collator names the sample and field), a model that is
            not a transformers model; varpack.attn.BackendUnavailableError: the backend cannot run here.
        ValueError: ``gated_delta_backend`` unknown, forced for a model without Gated DeltaNet layers, or
            forced and unable to run on the model's device (``gated_delta_backend='fla_hybrid': gated delta
            rule backend 'fla_hybrid' cannot run on cpu: fla_hybrid needs a CUDA device, got cpu``).
    """
    from varpack.collate import PaddingFreeCollator
    from varpack.integrations.transformers import enable_varpack
    from varpack.models.registry import require_gated_delta_layers

    rows = _as_sample_list(samples)
    require_gated_delta_layers(model, gated_delta_backend)
    model_dtype = next(model.parameters()).dtype
    dtype = dtype or model_dtype
    if dtype != model_dtype:
        model = copy.deepcopy(model).to(dtype)
    enable_varpack(model, backend=backend, linear_backend=gated_delta_backend)
    cp_state = _enable_context_parallel(model, context_parallel, context_parallel_attention)
    ref_attn = reference_attn or model._varpack_state.original_attn_implementation or "sdpa"
    device = next(model.parameters()).device
    # a forced gated delta rule backend that cannot run here: refused before anything runs
    gdn = _gated_delta_backend(model, device, gated_delta_backend)
    collate = PaddingFreeCollator()
    was_training = model.training
    model.eval()  # no dropout: the two runs must see the same function
    try:
        if cp_state is None:
            logits_p, loss_p, grads_p = _packed_run(model, collate, rows, device)
        else:
            logits_p, loss_p, grads_p = _context_parallel_run(model, collate, rows, device, cp_state)
        logits_u, loss_u, grads_u = _unpacked_run(model, collate, rows, device, ref_attn)
        truth = None
        if dtype in _LOW_PRECISION_ATOL:
            fp32 = copy.deepcopy(model).float()
            if gdn is not None:
                _truth_gated_delta(fp32, gated_delta_backend)
            truth = _unpacked_run(fp32, collate, rows, device, ref_attn)
            del fp32
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)

    logit_diff = _max_abs(logits_p, logits_u)
    grad_diffs = {n: _max_abs(grads_p[n], grads_u[n]) for n in grads_p}
    worst = max(grad_diffs, key=grad_diffs.get) if grad_diffs else None
    grad_diff = grad_diffs[worst] if worst else 0.0
    loss_packed, loss_unpacked = float(loss_p), float(loss_u)
    failures: list[str] = []
    result: dict[str, Any] = {
        "max_abs_logit_diff": logit_diff,
        "loss_packed": loss_packed,
        "loss_unpacked": loss_unpacked,
        "max_abs_grad_diff": grad_diff,
    }
    if truth is None:
        logit_scale = float(logits_u.abs().max()) if logits_u.numel() else 0.0
        tol = (1e-4 if atol is None else float(atol)) + 1e-5 * logit_scale
        if not logit_diff <= tol:
            failures.append(f"max_abs_logit_diff {logit_diff:.3g} > {tol:.3g} (atol + 1e-5 * max|logit|)")
        loss_tol = 1e-5 * max(1.0, abs(loss_unpacked))
        if not abs(loss_packed - loss_unpacked) <= loss_tol:
            failures.append(f"|loss diff| {abs(loss_packed - loss_unpacked):.3g} > {loss_tol:.3g}")
        for name, diff in grad_diffs.items():
            bound = FP32_GRAD_ATOL + 1e-3 * float(grads_u[name].abs().max())
            if not diff <= bound:
                failures.append(f"grad of {name}: max abs diff {diff:.3g} > {bound:.3g}")
        result["tolerance"] = {
            "logits_atol": tol,
            "loss": loss_tol,
            "grad": f"{FP32_GRAD_ATOL:g} + 1e-3 * max|g|",
        }
    else:
        tol = _LOW_PRECISION_ATOL[dtype] if atol is None else float(atol)
        logits_t, loss_t, grads_t = truth
        err_p, err_u = _max_abs(logits_p, logits_t), _max_abs(logits_u, logits_t)
        lerr_p, lerr_u = abs(loss_packed - float(loss_t)), abs(loss_unpacked - float(loss_t))
        gerr_p = {n: _max_abs(grads_p[n], grads_t[n]) for n in grads_p}
        gerr_u = {n: _max_abs(grads_u[n], grads_t[n]) for n in grads_p}
        if not err_p <= 2 * err_u + tol:
            failures.append(f"logits: err(packed) {err_p:.3g} > 2 * err(unpacked) {err_u:.3g} + {tol:.3g}")
        loss_atol = tol * 0.1
        if not lerr_p <= 2 * lerr_u + loss_atol:
            failures.append(
                f"loss: err(packed) {lerr_p:.3g} > 2 * err(unpacked) {lerr_u:.3g} + {loss_atol:.3g}"
            )
        failed_grads = []
        for name in grads_p:
            scale = float(grads_t[name].abs().max())
            bound = 2 * gerr_u[name] + tol * max(scale, 1e-6)
            if not gerr_p[name] <= bound:
                failed_grads.append(name)
                failures.append(
                    f"grad of {name}: err(packed) {gerr_p[name]:.3g} > 2 * err(unpacked) {gerr_u[name]:.3g} "
                    f"+ {tol:.3g} * max|g| {scale:.3g}"
                )
        result.update(
            logit_err_packed=err_p,
            logit_err_unpacked=err_u,
            loss_err_packed=lerr_p,
            loss_err_unpacked=lerr_u,
            grad_err_packed=max(gerr_p.values(), default=0.0),
            grad_err_unpacked=max(gerr_u.values(), default=0.0),
            loss_fp32=float(loss_t),
            tolerance={
                "rule": "err(packed) <= 2 * err(unpacked) + atol for the logits, + 0.1 * atol for the loss, "
                "+ atol * max|g| for each gradient (errors vs the fp32 truth)",
                "atol": tol,
            },
        )
    for key in ("loss_packed", "loss_unpacked"):
        if not math.isfinite(result[key]):
            failures.append(f"{key} is not finite ({result[key]})")
    if truth is not None and failures and len(failed_grads) == len(failures):
        if set(failed_grads) <= _gate_parameter_names(model):
            result["note"] = GATE_NOISE_NOTE.format(dtype=str(dtype).replace("torch.", ""))
    tf32_rule = _fla_rule_on_cuda(dtype, device, gdn)
    if truth is None and failures and tf32_rule:
        result["note"] = TF32_NOTE.format(backend=tf32_rule)
    longest = max((len(r["input_ids"]) for r in rows), default=None)
    name, reason = _resolved_backend(model, backend, device, dtype, longest)
    if gdn is not None:
        result.update(gated_delta_backend=gdn[0], gated_delta_reason=gdn[1])
    if cp_state is not None:
        result.update(context_parallel=cp_state.size, context_parallel_plan=dict(cp_state.plan))
    result.update(
        backend=name,
        backend_reason=reason,
        reference_attn=ref_attn,
        dtype=str(dtype).replace("torch.", ""),
        num_samples=len(rows),
        num_tokens=int(logits_p.shape[0]),
        num_params=len(grads_p),
        worst_grad_param=worst,
        failures=failures,
        passed=not failures,
    )
    return result
