"""Mamba-2 families: pure Mamba-2 and the Mamba-2 / attention hybrids (Bamba, Granite 4 hybrid, Nemotron-H,
Falcon-H1, Zamba2), ``tiny-mamba2``, ``tiny-bamba``, ``tiny-granite4-hybrid``, ``tiny-nemotron-h``,
``tiny-falcon-h1``, ``tiny-zamba2``.

Their Mamba-2 mixers run a causal depthwise short convolution and the SSD (selective state space) scan, both
of which would carry one sample's tokens into the next in a packed row; both are reset at every sample
boundary by :func:`varpack.integrations.mamba2.patch_mamba2_mixers` (``enable_varpack`` calls it). Their
attention layers (Bamba, Granite, Nemotron-H: whole layers; Falcon-H1: beside the mixer in every layer;
Zamba2: a shared attention block every few layers) run varpack attention; the MoE / MLP layers are per
token. Positions are 1-D.

Which modules are Mamba-2 mixers is this family's fact: :data:`MAMBA2_MIXER_CLASSES` (transformers 5.x class
names, each checked by name, never by a substring: a Mamba-1 ``MambaMixer`` is not one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from varpack.models.dense import QWEN3_VOCAB_SIZE, qwen3_special_ids
from varpack.models.registry import ModelFamily

__all__ = [
    "FAMILIES",
    "MAMBA2",
    "MAMBA2_MIXER_CLASSES",
    "TINY_BY_MODEL_TYPE",
    "TINY_MODELS",
    "is_mamba2_mixer",
    "tiny_config",
]

#: class name -> the forward variant the patched mixer runs ("mamba2": in_proj, conv, scan, gated RMSNorm,
#: out_proj; "falcon_h1": the same with Falcon-H1's multipliers and optional norm)
MAMBA2_MIXER_CLASSES: dict[str, str] = {
    "Mamba2Mixer": "mamba2",
    "BambaMixer": "mamba2",
    "GraniteMoeHybridMambaLayer": "mamba2",
    "NemotronHMamba2Mixer": "mamba2",
    "Zamba2MambaMixer": "mamba2",
    "FalconH1Mixer": "falcon_h1",
}

#: tokens per SSD chunk of the tiny configs: small, so that the tests' samples straddle chunks
TINY_CHUNK_SIZE = 16
#: weight init std of the tiny configs (1 / sqrt(hidden 64)): the mixers' outputs are O(1) in the residual
#: stream, so a packed run that leaked state between samples would show in the logits (with transformers'
#: 0.02 a leaking scan moved the logits of tiny-bamba by less than 1e-4 of their scale)
TINY_INIT_STD = 0.125
#: range of the time step ``softplus(dt_bias)`` at init (the Mamba-2 paper's, log-uniform): per-token decays
#: of 0.9-0.999 give the state a memory of tens of tokens (Bamba, Granite and Falcon-H1 init dt_bias to 1: a
#: memory of one or two tokens)
TINY_DT_RANGE = (1e-3, 1e-1)


def is_mamba2_mixer(module: torch.nn.Module) -> bool:
    """True for a transformers Mamba-2 mixer class varpack patches (:data:`MAMBA2_MIXER_CLASSES`)."""
    return type(module).__name__ in MAMBA2_MIXER_CLASSES


def _common(vocab_size: int | None) -> dict[str, Any]:
    vocab = int(vocab_size or QWEN3_VOCAB_SIZE)
    return {
        "vocab_size": vocab, "hidden_size": 64, "use_cache": False, "initializer_range": TINY_INIT_STD,
        **qwen3_special_ids(vocab),
    }  # fmt: skip


def _tiny_mamba2(vocab_size: int | None = None, **kw: Any) -> Any:
    """``tiny-mamba2``: ``Mamba2Config``, 2 layers of Mamba-2 mixers only (8 heads of 16, 2 groups, state
    16)."""
    from transformers import Mamba2Config

    c = _common(vocab_size)
    c.update(
        num_hidden_layers=2, num_heads=8, head_dim=16, expand=2, n_groups=2, state_size=16, conv_kernel=4,
        chunk_size=TINY_CHUNK_SIZE, tie_word_embeddings=False,
    )  # fmt: skip
    return Mamba2Config(**{**c, **kw})


def _tiny_bamba(vocab_size: int | None = None, **kw: Any) -> Any:
    """``tiny-bamba``: ``BambaConfig``, 4 layers (mixer, attention, mixer, mixer), 8 Mamba heads of 16."""
    from transformers import BambaConfig

    c = _common(vocab_size)
    c.update(
        intermediate_size=128, num_hidden_layers=4, attn_layer_indices=[1], num_attention_heads=4,
        num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=TINY_CHUNK_SIZE, tie_word_embeddings=False,
    )  # fmt: skip
    return BambaConfig(**{**c, **kw})


def _tiny_granite4_hybrid(vocab_size: int | None = None, **kw: Any) -> Any:
    """``tiny-granite4-hybrid``: ``GraniteMoeHybridConfig`` as Granite 4.0-H (no positional embedding, MoE
    with a shared MLP), 4 layers (mixer, attention, mixer, mixer), 4 experts top 2, 8 Mamba heads of 16."""
    from transformers import GraniteMoeHybridConfig

    c = _common(vocab_size)
    c.update(
        intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        position_embedding_type="nope", num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=64,
        mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=TINY_CHUNK_SIZE, embedding_multiplier=2.0, residual_multiplier=0.5,
        logits_scaling=2.0, attention_multiplier=0.25, tie_word_embeddings=False,
    )  # fmt: skip
    return GraniteMoeHybridConfig(**{**c, **kw})


def _tiny_nemotron_h(vocab_size: int | None = None, **kw: Any) -> Any:
    """``tiny-nemotron-h``: ``NemotronHConfig``, 4 blocks (mixer, MoE, attention, MLP), 8 Mamba heads of 16,
    2 groups, the Nemotron-H time-step floor (``time_step_limit`` from ``time_step_min``)."""
    from transformers import NemotronHConfig

    c = _common(vocab_size)
    c.update(
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp"], num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4,
        chunk_size=TINY_CHUNK_SIZE, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, n_group=1, topk_group=1, tie_word_embeddings=False,
    )  # fmt: skip
    return NemotronHConfig(**{**c, **kw})


def _tiny_falcon_h1(vocab_size: int | None = None, **kw: Any) -> Any:
    """``tiny-falcon-h1``: ``FalconH1Config``, 2 layers of attention beside a Mamba-2 mixer (8 heads of 16, no
    gated norm: Falcon-H1's ``mamba_rms_norm=False``), with Falcon-H1's muP multipliers set off 1."""
    from transformers import FalconH1Config

    c = _common(vocab_size)
    c.update(
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=TINY_CHUNK_SIZE, mamba_rms_norm=False,
        ssm_multipliers=[2.0, 1.5, 0.75, 1.25, 0.5], ssm_in_multiplier=1.5, ssm_out_multiplier=2.0,
        attention_in_multiplier=0.5, attention_out_multiplier=1.5, embedding_multiplier=2.0,
        lm_head_multiplier=0.5, key_multiplier=0.75, mlp_multipliers=[0.5, 2.0], tie_word_embeddings=False,
    )  # fmt: skip
    return FalconH1Config(**{**c, **kw})


def _tiny_zamba2(vocab_size: int | None = None, **kw: Any) -> Any:
    """``tiny-zamba2``: ``Zamba2Config``, 4 layers (mixer, shared attention + mixer, mixer, shared attention +
    mixer) with one shared block, its LoRA-style adapters and rotary positions, 8 Mamba heads of 16."""
    from transformers import Zamba2Config

    c = _common(vocab_size)
    c.update(
        num_hidden_layers=4, layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"],
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=128, n_mamba_heads=8,
        mamba_expand=2, mamba_ngroups=2, mamba_d_state=16, mamba_d_conv=4, chunk_size=TINY_CHUNK_SIZE,
        num_mem_blocks=1, use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True,
        tie_word_embeddings=False,
    )  # fmt: skip
    return Zamba2Config(**{**c, **kw})


_BUILDERS = {
    "tiny-mamba2": _tiny_mamba2,
    "tiny-bamba": _tiny_bamba,
    "tiny-granite4-hybrid": _tiny_granite4_hybrid,
    "tiny-nemotron-h": _tiny_nemotron_h,
    "tiny-falcon-h1": _tiny_falcon_h1,
    "tiny-zamba2": _tiny_zamba2,
}
TINY_MODELS = tuple(_BUILDERS)
#: model_type -> this family's tiny built-in of it (a model zoo's tiny config of the model type)
TINY_BY_MODEL_TYPE = {
    "mamba2": "tiny-mamba2",
    "bamba": "tiny-bamba",
    "granitemoehybrid": "tiny-granite4-hybrid",
    "nemotron_h": "tiny-nemotron-h",
    "falcon_h1": "tiny-falcon-h1",
    "zamba2": "tiny-zamba2",
}


def tiny_config(name: str, *, vocab_size: int | None = None, **overrides: Any) -> Any:
    """Config of a tiny random-init Mamba-2 model (:data:`TINY_MODELS`), ``overrides`` applied last.

    Raises:
        ValueError: an unknown name.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown tiny Mamba-2 model {name!r}; expected one of {TINY_MODELS}")
    return _BUILDERS[name](vocab_size, **overrides)


def _causal_lm(config: Any) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` in float32 (random init; the caller seeds), sdpa attention
    where the model has attention (pure Mamba-2 has none), every mixer's ``dt_bias`` drawn so that
    ``softplus(dt_bias)`` is log-uniform in :data:`TINY_DT_RANGE`."""
    from transformers import AutoModelForCausalLM

    attn = {} if config.model_type == "mamba2" else {"attn_implementation": "sdpa"}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **attn)
    low, high = (math.log(v) for v in TINY_DT_RANGE)
    with torch.no_grad():
        for mixer in (m for m in model.modules() if is_mamba2_mixer(m)):
            dt = torch.exp(torch.rand(mixer.dt_bias.shape) * (high - low) + low)
            mixer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) == dt
    return model


@dataclass(frozen=True)
class Mamba2Family(ModelFamily):
    """:class:`ModelFamily` whose decoder layers are the text model's ``layers`` (``NemotronHBlock``,
    ``Mamba2Block``, ``Zamba2HybridLayer`` are not named ``*DecoderLayer``) and whose linear layers are its
    Mamba-2 mixers (:func:`is_mamba2_mixer`)."""

    def decoder_layers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The entries of the text model's ``layers`` list (one per ``num_hidden_layers``)."""
        for owner in (getattr(model, "model", None), getattr(model, "backbone", None), model):
            layers = getattr(owner, "layers", None) if owner is not None else None
            if isinstance(layers, torch.nn.ModuleList):
                return list(layers)
        return super().decoder_layers(model)

    def linear_layers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The Mamba-2 mixers (:func:`is_mamba2_mixer`), in order."""
        return [m for m in model.modules() if is_mamba2_mixer(m)]


#: Mamba-2 and its hybrids: Mamba-2 mixers (+ attention), 1-D positions
MAMBA2 = Mamba2Family(
    name="mamba2",
    model_types=tuple(TINY_BY_MODEL_TYPE),
    mixers="mamba2",
    vision=False,
    position_ids="1d",
    builtins={name: partial(tiny_config, name) for name in TINY_MODELS},
    model_class=_causal_lm,
    tiny_configs={model_type: partial(tiny_config, name) for model_type, name in TINY_BY_MODEL_TYPE.items()},
)

FAMILIES = (MAMBA2,)
