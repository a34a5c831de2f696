"""The model-family registry: what varpack knows about each model family, asked in one place.

A :class:`ModelFamily` is a frozen record of one family's facts (the HF ``model_type`` values it covers, its
token mixers, whether it is vision-language, its position-id layout, its media fields, its built-in random-init
configs) and the hooks the rest of varpack asks it (:meth:`ModelFamily.is_vl`, :meth:`~ModelFamily.text_config`,
:meth:`~ModelFamily.decoder_layers`, :meth:`~ModelFamily.linear_layers`, :meth:`~ModelFamily.vision_tower`,
:meth:`~ModelFamily.rope_index`, :meth:`~ModelFamily.build`).

The built-in families live one per file (:mod:`varpack.models.dense`, :mod:`varpack.models.gated_delta`,
:mod:`varpack.models.qwen_vl`), each listing its records in ``FAMILIES``; :data:`FAMILY_MODULES` names those
files, so a new family is one file plus one line there (or one :func:`register_family` call from user code).

Models whose ``model_type`` no family covers keep working as they always have: :func:`family_of` returns
:data:`GENERIC`, whose hooks read the facts from the model itself (duck-typed: ``*DecoderLayer`` modules,
``*GatedDeltaNet`` modules, ``vision_config`` + ``image_token_id``, ``.visual``, ``get_rope_index``).
``family_of(..., strict=True)`` raises instead, naming the ``model_type``.

This module imports no family module at import time and no :mod:`varpack.integrations` module at all (the
integrations ask the registry).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import torch

__all__ = [
    "FAMILY_MODULES",
    "GENERIC",
    "POINTWISE_MODULE_PREFIXES",
    "ModelFamily",
    "builtin_family",
    "builtin_names",
    "families",
    "family_for_model_type",
    "family_of",
    "is_gated_delta_layer",
    "is_vl_model",
    "register_family",
    "require_gated_delta_layers",
    "unrecognised_module_classes",
    "unregister_family",
]

#: modules that define the built-in families (each has a ``FAMILIES`` tuple); loaded on first use
FAMILY_MODULES: tuple[str, ...] = (
    "varpack.models.dense",
    "varpack.models.gated_delta",
    "varpack.models.qwen_vl",
    "varpack.models.mamba2",
    "varpack.models.moe",
    "varpack.models.mla",
    "varpack.models.bert",
    "varpack.models.multimodal_text",
    "varpack.models.encoder_decoder",
    "varpack.models.refused",
)

Mixers = Literal["attention", "gated_delta", "mamba2"]
PositionLayout = Literal["1d", "mrope"]

#: class names of the transformers Gated DeltaNet mixers varpack's patch knows (Qwen3.5 text / VL, Qwen3-Next)
GATED_DELTA_LAYER_CLASSES: tuple[str, ...] = (
    "Qwen3_5GatedDeltaNet",
    "Qwen3NextGatedDeltaNet",
    "Qwen3_5MoeGatedDeltaNet",
)


def is_gated_delta_layer(module: torch.nn.Module) -> bool:
    """True for a Gated DeltaNet mixer: a class in :data:`GATED_DELTA_LAYER_CLASSES`, or any class named
    ``*GatedDeltaNet`` that has an ``A_log`` parameter (a new release's variant, checked for structure by
    :func:`varpack.integrations.gated_delta.patch_linear_attention`)."""
    name = type(module).__name__
    return name in GATED_DELTA_LAYER_CLASSES or (name.endswith("GatedDeltaNet") and hasattr(module, "A_log"))


def require_gated_delta_layers(
    model: torch.nn.Module,
    backend: str,
    *,
    setting: str = "gated_delta_backend",
    model_name: str | None = None,
) -> int:
    """The number of Gated DeltaNet mixers of ``model`` (:func:`is_gated_delta_layer`), refusing a forced
    gated delta rule backend for a model without any: a backend other than ``"auto"`` can only have been
    meant for a Qwen3.5 / Qwen3-Next model, and on a dense model it would change nothing.

    Args:
        model: the model (any ``torch.nn.Module``).
        backend: the requested backend: ``"auto"`` (always accepted) or a forced name.
        setting: the name the caller's user gave it under (``gated_delta_backend``, ``linear_backend``), for
            the message (the CLI turns ``gated_delta_backend=...`` into ``--gated-delta-backend ...``).
        model_name: what the user called the model (``tiny-qwen3``, a directory), shown beside its class.

    Raises:
        ValueError: ``backend`` is neither ``"auto"`` nor a name of :data:`varpack.ops.gated_delta_rule.BACKENDS`;
            ``backend != "auto"`` and the model has no Gated DeltaNet mixer. The message names the setting, the
            value and (the latter) the model.
    """
    from varpack.ops.gated_delta_rule import BACKENDS

    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(
            f"{setting}={backend!r} is not a gated delta rule backend; expected 'auto' or one of {BACKENDS}"
        )
    count = sum(1 for m in model.modules() if is_gated_delta_layer(m))
    if backend != "auto" and count == 0:
        label = (
            type(model).__name__ if model_name is None else f"model {model_name!r} ({type(model).__name__})"
        )
        raise ValueError(
            f"{setting}={backend!r} forces a gated delta rule backend, but {label} has no Gated DeltaNet "
            f"(linear-attention) layers: the setting applies to Qwen3.5 / Qwen3-Next models only; leave "
            f"{setting} at 'auto'"
        )
    return count


def _config_of(model_or_config: Any) -> Any:
    return getattr(model_or_config, "config", model_or_config)


def _has_vision(config: Any) -> bool:
    return (
        getattr(config, "vision_config", None) is not None
        and getattr(config, "image_token_id", None) is not None
    )


def _auto_causal_lm(config: Any) -> torch.nn.Module:
    """Random-init ``AutoModelForCausalLM.from_config(config)`` in float32 with sdpa attention, eager for a model
    that has no sdpa path (GPT-OSS: its sinks); the caller seeds."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    except ValueError as exc:
        if "scaled_dot_product_attention" not in str(exc):
            raise
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")


@dataclass(frozen=True)
class ModelFamily:
    """One model family's facts and hooks.

    Attributes:
        name: the family's name (``"dense"``, ``"gated-delta"``, ``"qwen-vl"``, ...), unique in the registry.
        model_types: the HF ``config.model_type`` values it covers (composite VL configs and their text
            sub-configs alike).
        mixers: its token mixers: ``"attention"`` (dense attention only; sliding windows included),
            ``"gated_delta"`` (Gated DeltaNet linear-attention layers beside full attention) or ``"mamba2"``
            (Mamba-2 mixers, with or without attention). ``None`` (:data:`GENERIC` only): read from the model.
        vision: vision-language (a vision tower whose features fill ``<|image_pad|>`` slots). ``None``
            (:data:`GENERIC`): read from the config.
        position_ids: ``"1d"`` (``[1, T]`` text positions) or ``"mrope"`` (``[4, 1, T]``, text plane first, the
            mRoPE planes from the model's own rope-index function: :mod:`varpack.rope.mrope`). ``None``
            (:data:`GENERIC`): mRoPE exactly when the model is vision-language.
        media_fields: the encoded-sample / batch fields (:mod:`varpack.schema` names) the model's forward and
            rope-index function take for its media; ``()`` for text models.
        builtins: ``{built-in name: config builder}``; a builder is called ``builder(vocab_size=None,
            **overrides)`` and returns a ``transformers`` config (``vocab_size=None``: the family's default).
        builtin_tokenizers: ``{built-in name: embedded tokenizer name}`` for names whose tokenizer is not the
            default ``"qwen3"`` (:func:`varpack.data.tokenizer.load_tokenizer`).
        model_class: ``config -> model``: builds the random-init float32 model of a built-in config (the
            caller seeds the RNG); ``None``: ``AutoModelForCausalLM.from_config(config, dtype=float32,
            attn_implementation="sdpa")``.
        tiny_configs: ``{model_type: config builder}``: the family's own tiny config of a model type, called
            ``builder(vocab_size=None)``; the model zoo (:func:`varpack.models.tiny.tiny_config`) prefers it to
            the generic shrinking of the config class's defaults.
        refused: the feature for which varpack refuses every model of the family (``enable_varpack`` raises
            naming it); ``None`` for a family varpack runs.
        not_applicable: why packing does not apply to the family's models (an encoder-decoder, a model whose
            inputs are not text tokens); ``enable_varpack`` refuses them with it. At most one of ``refused`` /
            ``not_applicable`` is set.
    """

    name: str
    model_types: tuple[str, ...]
    mixers: Mixers | None = "attention"
    vision: bool | None = False
    position_ids: PositionLayout | None = "1d"
    media_fields: tuple[str, ...] = ()
    builtins: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    builtin_tokenizers: Mapping[str, str] = field(default_factory=dict)
    model_class: Callable[[Any], torch.nn.Module] | None = None
    tiny_configs: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    refused: str | None = None
    not_applicable: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_types", tuple(self.model_types))
        object.__setattr__(self, "tiny_configs", MappingProxyType(dict(self.tiny_configs)))
        object.__setattr__(self, "media_fields", tuple(self.media_fields))
        object.__setattr__(self, "builtins", MappingProxyType(dict(self.builtins)))
        object.__setattr__(self, "builtin_tokenizers", MappingProxyType(dict(self.builtin_tokenizers)))
        unknown = sorted(set(self.builtin_tokenizers) - set(self.builtins))
        if unknown:
            raise ValueError(
                f"family {self.name!r}: builtin_tokenizers names {unknown} that are not builtins"
            )
        if self.refused is not None and self.not_applicable is not None:
            raise ValueError(f"family {self.name!r}: refused and not_applicable are exclusive")
        if self.mixers not in ("attention", "gated_delta", "mamba2", None):
            raise ValueError(
                f"family {self.name!r}: mixers={self.mixers!r}; expected 'attention', 'gated_delta' or 'mamba2'"
            )
        if self.position_ids not in ("1d", "mrope", None):
            raise ValueError(
                f"family {self.name!r}: position_ids={self.position_ids!r}; expected '1d' or 'mrope'"
            )

    # -- facts read off a model / config ----------------------------------------------------------------
    def covers(self, model_or_config: Any) -> bool:
        """True when the config's ``model_type`` is one of :attr:`model_types`."""
        return getattr(_config_of(model_or_config), "model_type", None) in self.model_types

    def is_vl(self, model_or_config: Any) -> bool:
        """True for a vision-language model/config of this family: a family with :attr:`vision` whose config
        has a ``vision_config`` and an ``image_token_id`` (a VL family's text-only sub-config is not)."""
        return self.vision is not False and _has_vision(_config_of(model_or_config))

    def text_config(self, model_or_config: Any) -> Any:
        """The config of the language model (``config.get_text_config()``; the config itself for text models)."""
        config = _config_of(model_or_config)
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    def position_layout(self, model_or_config: Any) -> PositionLayout:
        """``"1d"`` or ``"mrope"`` (see :attr:`position_ids`)."""
        if self.position_ids is not None:
            return self.position_ids
        return "mrope" if _has_vision(_config_of(model_or_config)) else "1d"

    def rope_index(self, model_or_config: Any) -> Callable[..., Any]:
        """The model's own rope-index function (:func:`varpack.rope.rope_index_fn`: its ``get_rope_index``).

        Raises:
            TypeError: a family with 1-D position ids (no rope-index function), or as
                :func:`varpack.rope.rope_index_fn`.
        """
        if self.position_layout(model_or_config) != "mrope":
            raise TypeError(
                f"model family {self.name!r} uses 1-D position_ids; it has no mRoPE rope-index function"
            )
        from varpack.rope.mrope import rope_index_fn

        return rope_index_fn(model_or_config)

    # -- modules of a model -----------------------------------------------------------------------------
    def decoder_layers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The decoder layers, in order: modules whose class name ends in ``DecoderLayer``
        (``Qwen3DecoderLayer``, ``LlamaDecoderLayer``, ``Qwen3_5DecoderLayer``, ...)."""
        return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]

    def linear_layers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The Gated DeltaNet mixers (:func:`is_gated_delta_layer`), in order; ``[]`` for dense families."""
        if self.mixers == "attention":
            return []
        return [m for m in model.modules() if is_gated_delta_layer(m)]

    def vision_tower(self, model: torch.nn.Module) -> torch.nn.Module:
        """The vision encoder: ``model.visual`` or ``model.model.visual`` (Qwen-VL layout).

        Raises:
            TypeError: a text family, or no vision tower found.
        """
        if self.vision is False:
            raise TypeError(f"{type(model).__name__} (model family {self.name!r}) has no vision tower")
        for owner in (model, getattr(model, "model", None)):
            visual = getattr(owner, "visual", None) if owner is not None else None
            if isinstance(visual, torch.nn.Module):
                return visual
        raise TypeError(f"{type(model).__name__} has no vision tower (.visual or .model.visual)")

    # -- building and preparing -------------------------------------------------------------------------
    def build(self, config: Any) -> torch.nn.Module:
        """A random-init float32 model of ``config`` (:attr:`model_class`); the caller seeds the RNG."""
        return (self.model_class or _auto_causal_lm)(config)


#: the fallback for a ``model_type`` no family covers: every fact read from the model (today's duck typing)
GENERIC = ModelFamily(name="generic", model_types=(), mixers=None, vision=None, position_ids=None)

_FAMILIES: dict[str, ModelFamily] = {}
_BY_MODEL_TYPE: dict[str, ModelFamily] = {}
_BY_BUILTIN: dict[str, ModelFamily] = {}
_LOADED = False


def _ensure_loaded() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for module_name in FAMILY_MODULES:
        for fam in importlib.import_module(module_name).FAMILIES:
            if fam.name not in _FAMILIES:
                register_family(fam)


def register_family(family: ModelFamily, *, replace: bool = False) -> ModelFamily:
    """Add a family: :func:`family_of` then answers it for its ``model_types``, and
    :func:`varpack.models.load_model` / :func:`varpack.models.model_config` accept its built-in names.

    Args:
        family: the record.
        replace: allow replacing a registered family of the same name (its model types and built-in names
            are released first).

    Returns:
        ``family``.

    Raises:
        ValueError: a family of that name exists (and ``replace`` is false), or one of its model types or
            built-in names belongs to another family (the message names both).
    """
    if not isinstance(family, ModelFamily):
        raise TypeError(f"register_family takes a ModelFamily, got {type(family).__name__}")
    _ensure_loaded()
    if family.name in _FAMILIES:
        if not replace:
            raise ValueError(
                f"model family {family.name!r} is already registered (replace=True to replace it)"
            )
        unregister_family(family.name)
    for model_type in family.model_types:
        other = _BY_MODEL_TYPE.get(model_type)
        if other is not None:
            raise ValueError(
                f"model_type {model_type!r} of family {family.name!r} is already covered by family {other.name!r}"
            )
    for builtin in family.builtins:
        other = _BY_BUILTIN.get(builtin)
        if other is not None:
            raise ValueError(
                f"built-in model {builtin!r} of family {family.name!r} already belongs to family {other.name!r}"
            )
    _FAMILIES[family.name] = family
    _BY_MODEL_TYPE.update(dict.fromkeys(family.model_types, family))
    _BY_BUILTIN.update(dict.fromkeys(family.builtins, family))
    return family


def unregister_family(name: str) -> ModelFamily:
    """Remove a registered family by name (its model types fall back to :data:`GENERIC`).

    Raises:
        KeyError: no family of that name.
    """
    _ensure_loaded()
    if name not in _FAMILIES:
        raise KeyError(f"no model family {name!r}; registered: {sorted(_FAMILIES)}")
    family = _FAMILIES.pop(name)
    for model_type in family.model_types:
        _BY_MODEL_TYPE.pop(model_type, None)
    for builtin in family.builtins:
        _BY_BUILTIN.pop(builtin, None)
    return family


def families() -> tuple[ModelFamily, ...]:
    """The registered families, in registration order."""
    _ensure_loaded()
    return tuple(_FAMILIES.values())


def builtin_names() -> tuple[str, ...]:
    """Every built-in (random-init) model name of the registered families, in registration order."""
    _ensure_loaded()
    return tuple(_BY_BUILTIN)


def builtin_family(name: str) -> ModelFamily | None:
    """The family that provides the built-in model ``name``, or ``None``."""
    _ensure_loaded()
    return _BY_BUILTIN.get(name)


def family_for_model_type(model_type: str) -> ModelFamily | None:
    """The registered family covering ``model_type`` (a ``config.model_type`` string), or ``None``."""
    _ensure_loaded()
    return _BY_MODEL_TYPE.get(model_type)


def family_of(model_or_config: Any, *, strict: bool = False) -> ModelFamily:
    """The family of a model, a ``transformers`` config, or a built-in model name.

    Args:
        model_or_config: a model (its ``.config`` is read), a config (its ``model_type``), or a built-in name.
        strict: raise for a ``model_type`` no family covers instead of returning :data:`GENERIC`.

    Returns:
        The registered family covering ``config.model_type``; :data:`GENERIC` otherwise (unless ``strict``).

    Raises:
        ValueError: an unknown built-in name, or (``strict``) an uncovered ``model_type`` (named, with the
            model types that are covered).
    """
    _ensure_loaded()
    if isinstance(model_or_config, str):
        family = _BY_BUILTIN.get(model_or_config)
        if family is None:
            raise ValueError(f"unknown built-in model {model_or_config!r}; choose one of {list(_BY_BUILTIN)}")
        return family
    config = _config_of(model_or_config)
    model_type = getattr(config, "model_type", None)
    family = _BY_MODEL_TYPE.get(model_type) if model_type is not None else None
    if family is not None:
        return family
    if strict:
        raise ValueError(
            f"no varpack model family covers model_type {model_type!r} ({type(model_or_config).__name__}); "
            f"covered: {sorted(_BY_MODEL_TYPE)} (register one with varpack.models.register_family)"
        )
    return GENERIC


#: module prefixes of classes that never mix tokens across positions (torch layers, activations, per-token
#: adapters and kernels): recognised in any model
POINTWISE_MODULE_PREFIXES: tuple[str, ...] = (
    "torch.",
    "transformers.activations",
    "transformers.pytorch_utils",
    "transformers.integrations.",
    "peft.",
    "liger_kernel.",
    "varpack.",
)


def _modeling_module(model_type: str) -> str:
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(model_type)
    return f"transformers.models.{name}.modeling_{name}"


def unrecognised_module_classes(model: torch.nn.Module) -> list[str]:
    """The module classes of ``model`` varpack has not verified as exact, ``module.QualName`` each, in order.

    A class is recognised when it is defined in the transformers modeling module of a model type covered by a
    family varpack runs (neither ``refused`` nor ``not_applicable``: the families verified by the model zoo,
    docs/MODELS.md) or under :data:`POINTWISE_MODULE_PREFIXES`. A model of a ``model_type`` no family covers
    (:data:`GENERIC`) runs only when this list is empty: built from known layers under another name.
    """
    _ensure_loaded()
    known = {
        _modeling_module(mt)
        for fam in _FAMILIES.values()
        if fam.refused is None and fam.not_applicable is None
        for mt in fam.model_types
    }
    out: list[str] = []
    for module in model.modules():
        cls = type(module)
        name = f"{cls.__module__}.{cls.__qualname__}"
        if cls.__module__.startswith(POINTWISE_MODULE_PREFIXES) or cls.__module__ in known or name in out:
            continue
        out.append(name)
    return out


def is_vl_model(model_or_config: Any) -> bool:
    """True for a vision-language model/config (Qwen-VL family: a ``vision_config`` and an ``image_token_id``);
    :meth:`ModelFamily.is_vl` of its family."""
    return family_of(model_or_config).is_vl(model_or_config)
