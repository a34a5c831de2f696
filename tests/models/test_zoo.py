"""The model zoo keeps docs/MODELS.md true: every causal-LM model type of the installed transformers is listed,
and each row's status (exact / refused / not applicable), family and reason is what varpack.zoo finds now (the
packed == unpacked check of a tiny random-init model, fp32, CPU). A row whose status changes fails here until the
file is regenerated (``varpack check --zoo --write docs/MODELS.md``).

Negative controls: a model type whose sinks are dropped silently, and an exact type that no family covers, land
in no state (ZooError), so neither can reach the matrix."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import transformers

import varpack.integrations.transformers as vt
from varpack.models import register_family, unregister_family
from varpack.models.dense import DENSE
from varpack.models.registry import ModelFamily
from varpack.zoo import STATUSES, ZooError, parse_matrix, run_model_type, zoo_model_types, zoo_samples

MATRIX = Path(__file__).resolve().parents[2] / "docs" / "MODELS.md"
TEXT = MATRIX.read_text(encoding="utf-8")
ROWS = parse_matrix(TEXT)
VERSION = re.search(r"from transformers (\S+):", TEXT).group(1)
SAMPLES = zoo_samples()
#: the model types the matrix must show exact (the acceptance list of the model-zoo work)
MUST_BE_EXACT = (
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next",
    "gemma2", "gemma3_text", "phi3", "olmo2", "olmo3", "olmoe", "gpt_oss", "deepseek_v3", "glm4", "granite",
    "cohere2", "smollm3", "starcoder2", "llama4_text",
)  # fmt: skip

same_transformers = pytest.mark.skipif(
    transformers.__version__ != VERSION,
    reason=f"docs/MODELS.md was generated with transformers {VERSION}, this is {transformers.__version__}",
)


@same_transformers
def test_matrix_lists_every_model_type_once_in_one_of_three_states():
    assert sorted(ROWS) == sorted(zoo_model_types())
    assert {row["status"] for row in ROWS.values()} <= set(STATUSES)
    for model_type, row in ROWS.items():
        if row["status"] != "exact":
            assert row["reason"], f"{model_type} is {row['status']} without a reason"
    exact = [t for t, row in ROWS.items() if row["status"] == "exact"]
    assert len(exact) >= 60
    assert [t for t in MUST_BE_EXACT if ROWS[t]["status"] != "exact"] == []
    counts = {s: sum(r["status"] == s for r in ROWS.values()) for s in STATUSES}
    assert f"{len(ROWS)} model types: {counts['exact']} exact, {counts['refused']} refused" in TEXT


@same_transformers
@pytest.mark.parametrize("model_type", sorted(ROWS))
def test_matrix_row_is_what_the_zoo_finds(model_type):
    result = run_model_type(model_type, samples=SAMPLES)
    row = ROWS[model_type]
    assert (result.status, result.family, result.reason) == (row["status"], row["family"], row["reason"]), (
        f"{model_type}: docs/MODELS.md says {row['status']} ({row['reason']}), the zoo finds {result.status} "
        f"({result.reason}); regenerate with: varpack check --zoo --write docs/MODELS.md"
    )


def test_sinks_dropped_silently_is_no_state(monkeypatch):
    """Negative control: were s_aux ignored as a neutral keyword (the old behaviour), GPT-OSS would come out
    inexact without a refusal: the zoo raises instead of writing a row."""
    vt.register_varpack_attention("auto")
    monkeypatch.setattr(vt, "NEUTRAL_ATTENTION_KWARGS", vt.NEUTRAL_ATTENTION_KWARGS | {"s_aux"})
    monkeypatch.setattr(vt, "IMPLEMENTED_ATTENTION_KWARGS", {})
    original = vt.varpack_attention_forward

    def dropping_sinks(*args, **kwargs):
        kwargs.pop("s_aux", None)
        return original(*args, **kwargs)

    for name in list(vt._REGISTERED):
        transformers.AttentionInterface.register(name, dropping_sinks)
    try:
        with pytest.raises(ZooError, match="packed != unpacked without a refusal"):
            run_model_type("gpt_oss", samples=SAMPLES)
    finally:
        for name, backend in vt._REGISTERED.items():
            fn = functools.partial(original, backend=backend)
            transformers.AttentionInterface.register(name, fn)


def test_exact_type_without_a_family_is_no_state_and_a_family_registered_later_is_used():
    unregister_family(DENSE.name)
    try:
        with pytest.raises(ZooError, match="no family covers model_type 'mistral'"):
            run_model_type("mistral", samples=SAMPLES)
        register_family(ModelFamily(name="later", model_types=("mistral",)))
        try:
            result = run_model_type("mistral", samples=SAMPLES)
        finally:
            unregister_family("later")
        assert (result.status, result.family) == ("exact", "later")
    finally:
        register_family(DENSE)
