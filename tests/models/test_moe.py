"""MoE routing on packed rows: the logits are exact per token (the model zoo), and the router's auxiliary
load-balancing loss of a packed row equals that of the same samples as a padded batch with the padding masked
(transformers' own definition, ``load_balancing_loss_func(..., attention_mask)``). Negative controls: the padded
batch without its mask, and the mean of per-sample losses, differ. The SFT objective adds the router loss as
the model's own forward does; linear CE (no head, no router loss) refuses ``output_router_logits``."""

from __future__ import annotations

import copy

import pytest
import torch

from varpack.collate import PaddingFreeCollator
from varpack.integrations.transformers import enable_varpack
from varpack.train.objectives.sft import CausalLMObjective
from varpack.zoo import build_tiny_model, zoo_samples

SAMPLES = zoo_samples((7, 10, 5, 3))


def _padded(samples):
    length = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    mask = torch.zeros(len(samples), length, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s["input_ids"])] = torch.tensor(s["input_ids"])
        mask[i, : len(s["input_ids"])] = 1
    return ids, mask


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "olmoe"])
def moe(request):
    model = build_tiny_model(request.param)
    model.config.output_router_logits = True
    padded_model = copy.deepcopy(model)  # transformers' own attention, for the padded batch
    enable_varpack(model, backend="reference")
    return model, padded_model


def test_router_aux_loss_packed_equals_padded_with_mask(moe):
    model, padded_model = moe
    batch = PaddingFreeCollator()([SAMPLES])
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "sample_ids")}
    packed = model(**inputs).aux_loss
    ids, mask = _padded(SAMPLES)
    masked = padded_model(input_ids=ids, attention_mask=mask).aux_loss
    unmasked = padded_model(input_ids=ids).aux_loss
    per_sample = torch.stack(
        [padded_model(input_ids=torch.tensor([s["input_ids"]])).aux_loss for s in SAMPLES]
    ).mean()
    torch.testing.assert_close(packed, masked, rtol=1e-5, atol=1e-7)
    assert abs(float((unmasked - masked).detach())) > 1e-4  # padding counted: another loss
    assert abs(float((per_sample - masked).detach())) > 1e-4  # a batch statistic, not a mean of per-sample ones


def test_sft_objective_adds_the_router_loss(moe):
    model, _ = moe
    batch = PaddingFreeCollator()([SAMPLES])
    objective = CausalLMObjective()
    with_aux = objective.loss(model, dict(batch))
    coef = model.config.router_aux_loss_coef
    assert coef > 0
    base = with_aux.loss - coef * with_aux.outputs.aux_loss
    model.config.output_router_logits = False
    try:
        without = objective.loss(model, dict(batch))
    finally:
        model.config.output_router_logits = True
    torch.testing.assert_close(base, without.loss, rtol=1e-6, atol=1e-7)
    assert float(with_aux.loss - without.loss) > 0
    with pytest.raises(ValueError, match="router"):
        objective.loss(model, dict(batch), linear_ce=True)
