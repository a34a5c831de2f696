"""The model zoo: every causal-LM model type of the installed transformers, packed == unpacked or refused by name.

For each model type of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (plus the Qwen-VL types of the
image-text-to-text mapping, :data:`VL_MODEL_TYPES`) :func:`run_model_type` builds a tiny random-init model
offline (:func:`varpack.models.tiny.tiny_config`), runs :func:`varpack.check.check_exactness` on
:data:`SAMPLE_LENGTHS` random samples (fp32, CPU: logits, loss and every gradient, packed in one row vs each
sample alone) and records one of three states, never a fourth:

* ``exact``: a family varpack runs covers the model type (:func:`varpack.models.registry.family_for_model_type`)
  and the check passes;
* ``refused``: varpack refuses such a model naming the feature: its family is ``refused``, or enabling /
  running it raises :class:`varpack.integrations.transformers.UnsupportedModelError` (a stateful mixer, an
  unknown layer type, an attention keyword, ...), or no family covers it and its tiny model cannot even be
  checked (``not verified: ...``; at run time varpack refuses such a model as unverified);
* ``not applicable``: packing does not apply (an encoder-decoder model, a family marked ``not_applicable``).

A model type no family covers is *probed*: registered for the check alone (a plain attention family), so its
refusal names the feature that stops it. A probe that passes, or any check that comes out inexact without a
refusal, is a :class:`ZooError` -- the silent state this module exists to rule out: the type must be added to
a family (verified exact) or to a refused one (the feature named). Families registered later
(:func:`varpack.models.register_family`, one file + one line in ``FAMILY_MODULES``) are picked up without a
change here: their model types then run through their family, with their own tiny config if the family gives
one (:attr:`varpack.models.ModelFamily.tiny_configs`).

:func:`render_matrix` writes docs/MODELS.md (``varpack check --zoo --write docs/MODELS.md``);
``tests/models/test_zoo.py`` re-runs every row and fails when a status changes until the file is regenerated.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = [
    "SAMPLE_LENGTHS",
    "STATUSES",
    "VL_MODEL_TYPES",
    "ZooError",
    "ZooResult",
    "build_tiny_model",
    "parse_matrix",
    "render_matrix",
    "run_model_type",
    "run_zoo",
    "token_mixers",
    "zoo_model_types",
    "zoo_samples",
]

#: the three states of a matrix row
STATUSES = ("exact", "refused", "not applicable")
#: tokens of the zoo's samples: longer than the tiny configs' sliding window and attention chunk (4 tokens), so
#: both are crossed; one packed row of 22 tokens
SAMPLE_LENGTHS = (7, 10, 5)
#: image-text-to-text model types of the Qwen-VL families (varpack packs their media); checked on text samples
#: with mRoPE positions here, on real images by tests/invariant/test_vision_language.py
VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
_PROBE = "zoo-probe"


class ZooError(RuntimeError):
    """A model type landed in none of :data:`STATUSES`: inexact without a refusal, exact without a family, or
    an unexpected error in a family varpack runs. The message says what to change."""


@dataclass(frozen=True)
class ZooResult:
    """One row of the matrix.

    Attributes:
        model_type: the mapping key (``"llama"``, ``"gpt-sw3"``, ...).
        family: the covering family's name, ``"-"`` when none covers it.
        mixers: the token mixers and feed-forward kinds, read from the tiny config and model
            (:func:`token_mixers`).
        status: one of :data:`STATUSES`.
        reason: the refused feature / why not applicable; for ``exact`` what was checked beyond the default.
        seconds: wall time of the row.
    """

    model_type: str
    family: str
    mixers: str
    status: str
    reason: str
    seconds: float = 0.0


def zoo_model_types() -> list[str]:
    """The installed transformers' causal-LM model types (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) followed by
    :data:`VL_MODEL_TYPES` that are not among them, in mapping order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    return types + [t for t in VL_MODEL_TYPES if t not in types]


def zoo_samples(lengths: Sequence[int] = SAMPLE_LENGTHS, seed: int = 0) -> list[dict[str, Any]]:
    """Random token samples (``labels[0] = -100``, every other token supervised) of ``lengths`` tokens, ids in
    :data:`varpack.models.tiny.SAMPLE_TOKEN_RANGE` (below every special token of a tiny config)."""
    from varpack.models.tiny import SAMPLE_TOKEN_RANGE

    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(*SAMPLE_TOKEN_RANGE, (n,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100, *ids[1:]], "sample_id": i})
    return out


def _config_model_type(model_type: str) -> str:
    from transformers import CONFIG_MAPPING

    return getattr(CONFIG_MAPPING[model_type], "model_type", model_type) or model_type


def build_tiny_model(model_type: str, *, seed: int = 0) -> Any:
    """A random-init float32 model of ``model_type``'s tiny config: its causal LM (the image-text-to-text model
    for :data:`VL_MODEL_TYPES`), transformers' sdpa attention where it has it, else eager; built by the family
    (:meth:`varpack.models.ModelFamily.build`) when the family gives the tiny config itself.

    Raises:
        whatever transformers raises for a config it cannot build (the zoo records it).
    """
    import transformers

    from varpack.models.registry import family_for_model_type
    from varpack.models.tiny import tiny_config

    config = tiny_config(model_type)
    family = family_for_model_type(config.model_type)
    auto = transformers.AutoModelForCausalLM
    if model_type in VL_MODEL_TYPES:
        auto = transformers.AutoModelForImageTextToText
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if family is not None and model_type in family.tiny_configs:  # the family's own tiny model
            return family.build(config)
        try:
            return auto.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        except (ValueError, ImportError) as exc:
            if "sdpa" not in str(exc).lower() and "scaled_dot_product" not in str(exc).lower():
                raise
            return auto.from_config(config, dtype=torch.float32, attn_implementation="eager")


def token_mixers(config: Any, model: Any = None) -> str:
    """The row's token mixers / feed-forward kinds, e.g. ``"attention (full, sliding), MoE, sinks"``: layer types
    (or ``attention``), MLA, MoE, NoPE layers, softcap, sinks (a ``sinks`` parameter), stateful mixers (class
    names of the model)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    values = text.to_dict()
    types = values.get("layer_types") or values.get("layers_block_type") or []
    kinds = []
    for t in types:
        name = str(t).replace("_attention", "")
        if name not in kinds:
            kinds.append(name)
    if not kinds:
        kinds = ["full"]
        if isinstance(values.get("sliding_window"), int) and values.get("use_sliding_window", True):
            kinds.append("sliding")
    has_attention = bool(values.get("num_attention_heads") or values.get("n_head"))
    if model is not None:
        has_attention = any(re.search(r"Attention|Attn|MLA", type(m).__name__) for m in model.modules())
    parts = [f"attention ({', '.join(kinds)})"] if has_attention or types else []
    if values.get("kv_lora_rank"):
        parts.append("MLA")
    experts = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
    if any(isinstance(values.get(k), int) and values.get(k) > 1 for k in experts):
        parts.append("MoE")
    if values.get("no_rope_layers") or values.get("no_rope_layer_interval"):
        parts.append("NoPE layers")
    if values.get("attn_logit_softcapping"):
        parts.append("softcap")
    if model is not None:
        names = {n.rsplit(".", 1)[-1] for n, _ in model.named_parameters()}
        if "sinks" in names:
            parts.append("sinks")
        mixers = sorted(
            {
                type(m).__name__
                for m in model.modules()
                if re.search(r"Mamba|ShortConv|Rwkv|RWKV|LSTM|Recurrent|DeltaNet|DeltaAttention|Lightning", type(m).__name__)
                and not type(m).__name__.endswith(("ForCausalLM", "Model", "DecoderLayer", "Block", "Layer"))
                and "Norm" not in type(m).__name__
            }
        )
        parts.extend(mixers[:2])
    return ", ".join(parts) or "-"


def _short(exc: BaseException, limit: int = 140) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = re.sub(r"0x[0-9a-f]+", "0x..", text)
    text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _vl_samples(model: Any, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from varpack.rope import add_mrope_position_ids

    return [add_mrope_position_ids(dict(s), model, sample_id=s["sample_id"]) for s in samples]


def run_model_type(model_type: str, *, samples: list[dict[str, Any]] | None = None) -> ZooResult:
    """Check one model type and classify it (module docstring).

    Args:
        model_type: a key of ``CONFIG_MAPPING`` (the mapping's spelling, e.g. ``"gpt-sw3"``).
        samples: the samples to pack (default :func:`zoo_samples`).

    Returns:
        The row.

    Raises:
        ZooError: the model type lands in no state (what to change is in the message).
    """
    from varpack.check import check_exactness
    from varpack.integrations.transformers import UnsupportedModelError
    from varpack.models.registry import ModelFamily, family_for_model_type, register_family, unregister_family

    start = time.perf_counter()
    config_type = _config_model_type(model_type)
    family = family_for_model_type(config_type)

    def row(status: str, reason: str, mixers: str = "-") -> ZooResult:
        return ZooResult(
            model_type, family.name if family else "-", mixers, status, reason, time.perf_counter() - start
        )

    if family is not None and family.not_applicable:
        return row("not applicable", family.not_applicable)
    if family is not None and family.refused:
        return row("refused", family.refused)
    runnable = family is not None
    try:
        model = build_tiny_model(model_type)
    except Exception as exc:  # transformers refuses the tiny config: the type cannot be verified
        if runnable:
            raise ZooError(
                f"{model_type}: family {family.name!r} covers it but its tiny config does not build ({_short(exc)}); "
                "fix varpack.models.tiny (TINY_OVERRIDES) or give the family a tiny_configs entry"
            ) from exc
        return row("refused", f"not verified: tiny config does not build ({_short(exc)})")
    mixers = token_mixers(model.config, model)
    rows = zoo_samples() if samples is None else [dict(s) for s in samples]
    probe = None
    if not runnable:
        probe = register_family(ModelFamily(name=_PROBE, model_types=(config_type,)), replace=True)
    try:
        if model_type in VL_MODEL_TYPES:
            rows = _vl_samples(model, rows)
        result = check_exactness(model, rows)
    except UnsupportedModelError as exc:
        return row("refused" if exc.applicable else "not applicable", exc.feature, mixers)
    except Exception as exc:
        if runnable:
            raise ZooError(f"{model_type} (family {family.name!r}): the check raised {_short(exc, 400)}") from exc
        return row("refused", f"not verified: the check raised {_short(exc)}", mixers)
    finally:
        if probe is not None:
            unregister_family(_PROBE)
    if not result["passed"]:
        raise ZooError(
            f"{model_type}: packed != unpacked without a refusal ({'; '.join(result['failures'][:3])}): a silent "
            "leak. Refuse the feature that causes it (a refused family in varpack/models/, or a check in "
            "varpack.integrations.transformers) or make it exact"
        )
    if not runnable:
        raise ZooError(
            f"{model_type}: exact on its tiny config but no family covers model_type {config_type!r}: add it to a "
            "family's model_types (varpack/models/) so varpack runs it"
        )
    reason = ""
    if model_type in VL_MODEL_TYPES:
        reason = "text with mRoPE positions here; images in tests/invariant/test_vision_language.py"
    elif family.name == "multimodal-text":
        reason = "text-only batches; media in a packed batch refused"
    return row("exact", reason, mixers)


def run_zoo(
    model_types: Iterable[str] | None = None,
    *,
    progress: Callable[[ZooResult], None] | None = None,
) -> list[ZooResult]:
    """:func:`run_model_type` over ``model_types`` (default :func:`zoo_model_types`), one sample set shared.

    Raises:
        ZooError: after every type ran, naming each type that landed in no state (their messages).
    """
    samples = zoo_samples()
    results, errors = [], []
    for model_type in model_types if model_types is not None else zoo_model_types():
        try:
            result = run_model_type(model_type, samples=samples)
        except ZooError as exc:
            errors.append(str(exc))
            continue
        results.append(result)
        if progress is not None:
            progress(result)
    if errors:
        raise ZooError(f"{len(errors)} model type(s) in no state:\n" + "\n".join(errors))
    return results


_HEADER = "| family | model type | token mixers | status | reason |"


def render_matrix(results: Sequence[ZooResult], *, transformers_version: str | None = None) -> str:
    """docs/MODELS.md: a header with the counts and the transformers version, then one table row per result,
    sorted by status then family then model type."""
    import transformers

    version = transformers_version or transformers.__version__
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    order = {s: i for i, s in enumerate(STATUSES)}
    lines = [
        "# Models: packed == unpacked, or refused by name",
        "",
        "Generated by `varpack check --zoo --write docs/MODELS.md` (`varpack/zoo.py`) from transformers "
        f"{version}: every model type of its causal-LM mapping and the Qwen-VL image-text-to-text types, each "
        "run as a tiny random-init model (fp32, CPU) packed in one row against each sample alone (logits, loss, "
        "every gradient; `varpack.check.check_exactness`). Do not edit by hand: `tests/models/test_zoo.py` "
        "fails when a row's status changes until the file is regenerated.",
        "",
        f"**{len(results)} model types: {counts['exact']} exact, {counts['refused']} refused, "
        f"{counts['not applicable']} not applicable.** `refused` names the feature varpack refuses at run time "
        "(`UnsupportedModelError`); `not verified` means no family covers the type and its tiny model could not "
        "be checked, and varpack refuses it as unverified.",
        "",
        _HEADER,
        "|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (order[r.status], r.family, r.model_type)):
        cells = [r.family, f"`{r.model_type}`", r.mixers, r.status, r.reason]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def parse_matrix(text: str) -> dict[str, dict[str, str]]:
    """The rows of a rendered matrix: ``{model_type: {"family", "mixers", "status", "reason"}}``.

    Raises:
        ValueError: no table, or a row that does not parse.
    """
    rows: dict[str, dict[str, str]] = {}
    lines = text.splitlines()
    if _HEADER not in lines:
        raise ValueError("no model table (its header line is missing)")
    for line in lines[lines.index(_HEADER) + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) != 5:
            raise ValueError(f"matrix row does not have 5 cells: {line!r}")
        family, model_type, mixers, status, reason = cells
        rows[model_type.strip("`")] = {"family": family, "mixers": mixers, "status": status, "reason": reason}
    return rows


def as_dict(result: ZooResult) -> dict[str, Any]:
    """A row as a JSON-ready dict."""
    return asdict(result)
