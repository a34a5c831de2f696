"""Boundary-exact packing for Mamba-2 mixers (transformers' Mamba-2, Bamba, Granite 4 hybrid, Nemotron-H,
Falcon-H1, Zamba2).

A packed row must reset a Mamba-2 mixer at every sample boundary in TWO places: the causal depthwise short
convolution over ``x, B, C`` (its first taps would read the previous sample's last tokens) and the SSD scan's
state. :func:`patch_mamba2_mixers` replaces the ``forward`` of every mixer of :data:`MAMBA2_MIXER_CLASSES`
with one that, on a packed batch, runs the mixer's own projections, parameters and gated norm with
:func:`varpack.ops.short_conv` and :func:`varpack.ops.ssd.ssd_scan` reading the batch's boundaries; without
boundaries it calls the original ``forward`` unchanged (an unpacked sample, generation with a cache).

The math is the mixer's own PyTorch path (transformers 5.x ``torch_forward``, the same in every class listed):
``in_proj`` -> ``gate, xBC, dt`` -> ``conv1d`` + activation over ``xBC`` -> ``x, B, C`` -> the scan with
``A = -exp(A_log)``, ``dt = clamp(softplus(dt + dt_bias), *time_step_limit)``, ``D`` skip -> the gated
RMSNorm (``norm(y, gate)``, its groups) -> ``out_proj``. Falcon-H1 adds its multipliers (``ssm_in_multiplier``
before ``in_proj``, ``mup_vector`` after it) and, without ``mamba_rms_norm``, gates with ``silu(gate)``
instead of the norm.

Where the boundaries come from: the batch's :class:`varpack.varlen.VarlenMeta` (``varlen_meta``), which
``enable_varpack``'s guard builds once per forward and transformers hands to every decoder layer and on to
the mixer (``**kwargs``); a pre-hook on each mixer's parent layer hands it over as well for releases that
call the mixer without those kwargs, and a pre-hook on the text model builds it once from ``cu_seq_lens_q``
/ ``seq_idx`` when the model was patched without ``enable_varpack``. The scan's chunk masks
(:func:`varpack.ops.ssd.prepare_ssd_layout`) and the conv's ``seq_idx`` are built once per batch, at the
first mixer, and kept on the meta: no host sync per layer.

Refused (``ValueError`` / ``TypeError`` naming the layer and the feature): boundaries with a batch of more
than one row, with a cache (the conv / SSM state of a pack mixes samples: packing is for training), with a
positional argument other than ``None`` or a state keyword (``initial_states``, ``cu_seqlens``, ...); a LoRA /
peft adapter on ``conv1d``; a mixer whose structure or ``time_step_limit`` varpack does not know.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from varpack.integrations.recurrent import CACHE_KEYS, conv_activation, current_meta, install_mixer_hooks
from varpack.models.mamba2 import MAMBA2_MIXER_CLASSES, is_mamba2_mixer
from varpack.ops.short_conv import short_conv
from varpack.ops.ssd import BACKENDS, SSDLayout, prepare_ssd_layout, resolve_ssd_backend, ssd_scan
from varpack.ops.ssd._common import normalize_dt_limit
from varpack.varlen.meta import VarlenMeta

__all__ = ["patch_mamba2_mixers", "ssd_backend"]

#: keywords that would hand a mixer state or boundaries varpack's packed path does not read: refused
_STATE_KEYS = (
    "initial_states",
    "return_final_states",
    "return_varlen_states",
    "cu_seqlens",
    "conv_state",
    "ssm_state",
)


def _where(layer: torch.nn.Module) -> str:
    return f"{type(layer).__name__}(layer_idx={getattr(layer, 'layer_idx', '?')})"


def _layout(meta: VarlenMeta, chunk_size: int, device: torch.device) -> SSDLayout:
    """The SSD chunk masks of this batch at ``chunk_size`` on ``device``, built once (first mixer) and kept on
    the meta, from the meta's host offsets (read once, while validating) and device ``seq_idx`` (built
    once)."""
    offsets, seq_idx = meta.host_offsets()[0], meta.seq_idx_on(device)  # outside build(): memo's lock
    return meta.memo(
        ("ssd_layout", chunk_size, str(device)),
        lambda: prepare_ssd_layout(
            meta.total_q, chunk_size, cu_seqlens=offsets, seq_idx=seq_idx, device=device
        ),
    )


def _needs_grad(layer: torch.nn.Module, hidden_states: torch.Tensor) -> bool:
    # training mode counts as needing gradients (reentrant checkpointing runs its first forward without grad,
    # and the recomputation must take the same backend)
    return layer.training or (
        torch.is_grad_enabled()
        and (hidden_states.requires_grad or any(p.requires_grad for p in layer.parameters()))
    )


def _padding_masked(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """transformers' ``apply_mask_to_padding_states``: a 2-D mask zeroes padded tokens (no host read)."""
    if attention_mask is not None and attention_mask.dim() == 2:
        return (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    return hidden_states


def _packed_forward(
    layer: torch.nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, meta: VarlenMeta
) -> torch.Tensor:
    B, T, _ = hidden_states.shape
    dtype = hidden_states.dtype
    device = hidden_states.device
    falcon = MAMBA2_MIXER_CLASSES[type(layer).__name__] == "falcon_h1"
    H, P, G, S = layer.num_heads, layer.head_dim, layer.n_groups, layer.ssm_state_size

    hidden_states = _padding_masked(hidden_states, attention_mask)
    if falcon:
        hidden_states = hidden_states * layer.ssm_in_multiplier
    projected = layer.in_proj(hidden_states)
    if falcon:
        projected = projected * layer.mup_vector
    gate, xbc, dt = projected.split([layer.intermediate_size, layer.conv_dim, H], dim=-1)

    # 1. the short convolution over x, B, C: no tap reads across a boundary
    backend = getattr(layer, "_varpack_ssd_backend", "auto")
    activation = conv_activation(layer.activation)
    kernel_ok = activation in (None, "silu", "swish")  # fla's causal_conv1d takes no other activation
    conv_backend = (
        "auto" if backend in ("auto", "mamba_ssm") and device.type == "cuda" and kernel_ok else "torch"
    )
    if conv_backend != "torch":
        conv_kwargs = {"cu_seqlens": meta.cu_seqlens_on(device)[0], "cu_seqlens_cpu": meta.cu_seqlens_cpu()}
    else:
        conv_kwargs = {"seq_idx": meta.seq_idx_on(device)}
    weight = layer.conv1d.weight
    xbc = short_conv(
        xbc,
        weight.reshape(weight.shape[0], -1),
        layer.conv1d.bias,
        activation,
        backend=conv_backend,
        **conv_kwargs,
    )
    xbc = _padding_masked(xbc, attention_mask)
    x, Bm, Cm = xbc.split([layer.intermediate_size, G * S, G * S], dim=-1)

    # 2. the SSD scan: the state restarts at every sample
    name = resolve_ssd_backend(backend, device, needs_grad=_needs_grad(layer, hidden_states))
    if name == "naive":
        bounds: dict[str, Any] = {"cu_seqlens": meta.cu_seqlens_cpu()}
    elif name == "mamba_ssm":
        bounds = {"seq_idx": meta.seq_idx_on(device)}
    else:
        bounds = {"layout": _layout(meta, layer.chunk_size, device)}
    y, _ = ssd_scan(
        x.reshape(B, T, H, P),
        dt,
        -torch.exp(layer.A_log.float()),
        Bm.reshape(B, T, G, S),
        Cm.reshape(B, T, G, S),
        chunk_size=layer.chunk_size,
        D=layer.D,
        dt_bias=layer.dt_bias,
        dt_softplus=True,
        dt_limit=layer.time_step_limit,
        backend=name,
        **bounds,
    )
    y = y.reshape(B, T, H * P)  # fp32, as the mixer's own PyTorch scan returns it

    # 3. gated norm (or Falcon-H1's plain gate) and the output projection, as the mixer
    if falcon and not layer.mamba_rms_norm:
        y = y * F.silu(gate)
    else:
        y = layer.norm(y, gate)
    return layer.out_proj(y.to(dtype))


def _patched_forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    if torch.compiler.is_compiling():
        # inside a torch.compile'd decoder layer: the mixer is a graph break, like varpack attention
        return _patched_forward_outside_graph(self, hidden_states, *args, **kwargs)
    B, T = hidden_states.shape[:2]
    meta = current_meta(self, T, kwargs)
    if meta is None:
        return self._varpack_ssd_original_forward(hidden_states, *args, **kwargs)
    where = _where(self)
    if B != 1:
        raise ValueError(
            f"{where}: packed boundaries need one row [1, T], got hidden_states {tuple(hidden_states.shape)}"
        )
    given = [i for i, a in enumerate(args) if a is not None]
    if given:
        raise ValueError(
            f"{where}: packed batch with positional argument(s) {given} besides hidden_states; the packed "
            "path takes cache / attention_mask by keyword (and no cache)"
        )
    cache = next((kwargs[k] for k in CACHE_KEYS if kwargs.get(k) is not None), None)
    if cache is not None:
        raise ValueError(
            f"{where}: packed batch with a cache ({type(cache).__name__}); the conv and SSM states of a pack "
            "would mix its samples: packing is for training (use_cache=False, no cache)"
        )
    state = sorted(k for k in _STATE_KEYS if kwargs.get(k) is not None)
    if state:
        raise ValueError(
            f"{where}: packed batch with {state}, which varpack's packed Mamba-2 path does not read"
        )
    return _packed_forward(self, hidden_states, kwargs.get("attention_mask"), meta)


_patched_forward_outside_graph = torch.compiler.disable(_patched_forward)


def _check_mixer(module: torch.nn.Module) -> None:
    """The mixer has the structure and settings the packed path reads; else an error naming what is
    missing."""
    need = [
        "in_proj", "conv1d", "A_log", "D", "dt_bias", "norm", "out_proj", "num_heads", "head_dim", "n_groups",
        "ssm_state_size", "intermediate_size", "conv_dim", "chunk_size", "time_step_limit", "activation",
    ]  # fmt: skip
    if MAMBA2_MIXER_CLASSES[type(module).__name__] == "falcon_h1":
        need += ["mup_vector", "ssm_in_multiplier", "mamba_rms_norm"]
    missing = [n for n in need if not hasattr(module, n)]
    where = _where(module)
    if missing:
        raise TypeError(
            f"{where} does not have the Mamba-2 mixer structure varpack knows (missing {missing}); it cannot "
            "be patched for packed batches"
        )
    H, P, G, S = module.num_heads, module.head_dim, module.n_groups, module.ssm_state_size
    if (
        H * P != module.intermediate_size
        or G < 1
        or H % G
        or module.conv_dim != module.intermediate_size + 2 * G * S
    ):
        raise TypeError(
            f"{where}: heads x head_dim = {H} x {P}, groups {G}, state {S}, intermediate_size "
            f"{module.intermediate_size}, conv_dim {module.conv_dim} do not form the Mamba-2 layout varpack "
            "knows"
        )
    conv = module.conv1d
    if hasattr(conv, "base_layer"):
        raise ValueError(
            f"{where}.conv1d carries a LoRA / peft adapter; the packed short convolution reads conv1d.weight "
            "directly and would drop it: leave conv1d out of the adapter's target modules"
        )
    if not isinstance(conv, torch.nn.Conv1d) or conv.groups != module.conv_dim or conv.weight.shape[1] != 1:
        raise TypeError(f"{where}.conv1d is not the depthwise Conv1d over conv_dim channels varpack knows")
    try:
        normalize_dt_limit(module.time_step_limit)
    except ValueError as exc:
        raise ValueError(
            f"{where}: time_step_limit={module.time_step_limit!r} is not supported: {exc}"
        ) from None
    if module.activation not in (None, "silu", "swish"):
        from transformers.activations import ACT2FN

        if module.activation not in ACT2FN:
            raise ValueError(
                f"{where}: conv activation {module.activation!r} is not a transformers activation"
            )


def patch_mamba2_mixers(model: torch.nn.Module, *, backend: str = "auto") -> int:
    """Make every Mamba-2 mixer of ``model`` reset its short conv and SSD state at sample boundaries.

    After patching, a forward with the batch's ``varlen_meta`` (or ``cu_seq_lens_q`` ``[N+1]`` int32 CPU /
    ``seq_idx`` ``[1, T]``) over a packed ``input_ids [1, T]`` equals running the ``N`` samples one by one
    (logits, loss, gradients); a forward without them is the original. Idempotent: patching again only
    updates ``backend``.

    Args:
        model: a transformers model (or module) containing mixers of :data:`MAMBA2_MIXER_CLASSES`.
        backend: SSD scan backend, ``"auto"`` (mamba_ssm on CUDA when importable and its probe passes, else
            ``chunk``), ``"mamba_ssm"``, ``"chunk"`` or ``"naive"`` (:mod:`varpack.ops.ssd.dispatch`). With
            ``"auto"`` / ``"mamba_ssm"`` on CUDA the short conv takes fla's ``causal_conv1d`` where its probe
            passed (:func:`varpack.ops.short_conv.resolve_conv_backend`).

    Returns:
        The number of mixers patched (0 for a model without any).

    Raises:
        ValueError: an unknown backend; a LoRA adapter on a mixer's ``conv1d``; an unsupported
            ``time_step_limit``.
        TypeError: a mixer whose structure varpack does not know.
        (At forward time) ValueError: boundaries with ``B > 1``, with a cache or state keywords, or not
        covering the row; RuntimeError: a forced backend that cannot run on the device.
    """
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"unknown SSD backend {backend!r}; expected 'auto' or one of {BACKENDS}")
    mixers = [m for m in model.modules() if is_mamba2_mixer(m)]
    for m in mixers:
        _check_mixer(m)
    if not mixers:
        return 0
    install_mixer_hooks(model, mixers, _patched_forward, original_attr="_varpack_ssd_original_forward")
    for m in mixers:
        m._varpack_ssd_backend = backend
    return len(mixers)


def ssd_backend(model: torch.nn.Module, device: torch.device | str, *, needs_grad: bool = True) -> str | None:
    """The SSD scan backend the Mamba-2 mixers of ``model`` run on ``device`` (``None`` without mixers).

    Raises:
        RuntimeError: a forced backend that cannot run there, with its reason.
        ValueError: the mixers carry different backends.
    """
    mixers = [m for m in model.modules() if is_mamba2_mixer(m)]
    if not mixers:
        return None
    names = sorted({getattr(m, "_varpack_ssd_backend", "auto") for m in mixers})
    if len(names) > 1:
        raise ValueError(
            f"the Mamba-2 mixers of {type(model).__name__} carry different SSD backends {names}; patch them "
            "with one (patch_mamba2_mixers(model, backend=...))"
        )
    return resolve_ssd_backend(names[0], torch.device(device), needs_grad=needs_grad)
