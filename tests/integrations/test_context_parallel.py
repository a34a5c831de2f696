"""Context parallelism, the single-process parts: what each layer kind runs (Ulysses / ring, KV-head
replication, refusals named), the guards around a shard, the objective's refusals, the config and flags.
The multi-rank exactness runs in tests/train/test_context_parallel_gloo.py."""

from __future__ import annotations

import pytest
import torch

from varpack.attn.context_parallel import (
    CONTEXT_PARALLEL_ATTENTION,
    kv_replication,
    resolve_context_parallel_attention,
)
from varpack.collate import PaddingFreeCollator, shard_batch
from varpack.integrations.context_parallel import context_parallel_plan, enable_context_parallel
from varpack.integrations.transformers import PackingGuardError
from varpack.models import load_model
from varpack.schema import NOT_MODEL_INPUTS
from varpack.train.config import SFTConfig, check_context_parallel, literal_choices


def _batch(lengths=(6, 5, 9)):
    g = torch.Generator().manual_seed(0)
    pack = []
    for n in lengths:
        ids = torch.randint(1, 200, (n,), generator=g).tolist()
        pack.append({"input_ids": ids, "labels": [-100] + ids[1:]})
    return PaddingFreeCollator()([pack])


@pytest.mark.parametrize(
    ("heads", "kv", "size", "rep"),
    [(4, 2, 2, 1), (4, 2, 4, 2), (8, 2, 4, 2), (12, 3, 4, 4), (16, 8, 8, 1), (8, 1, 8, 8)],
)
def test_kv_replication_makes_kv_heads_divide_and_keeps_the_gqa_map(heads, kv, size, rep):
    assert kv_replication(heads, kv, size) == rep
    assert (kv * rep) % size == 0 and heads % (kv * rep) == 0


def test_modes():
    assert CONTEXT_PARALLEL_ATTENTION == ("auto", "ulysses", "ring")
    assert resolve_context_parallel_attention("auto", 4, 2) == "ulysses"
    assert resolve_context_parallel_attention("auto", 4, 3) == "ring"
    assert resolve_context_parallel_attention("ring", 4, 2) == "ring"
    with pytest.raises(ValueError, match="4 attention heads over 3 context-parallel ranks"):
        resolve_context_parallel_attention("ulysses", 4, 3)
    with pytest.raises(ValueError, match="unknown context-parallel attention 'stripes'"):
        resolve_context_parallel_attention("stripes", 4, 2)


def test_plan_per_layer_kind_and_gated_delta_refusal():
    dense = load_model("tiny-qwen3", vocab_size=64)
    assert context_parallel_plan(dense, 2) == {"attention": "ulysses (4 heads / 2 ranks, 2 KV heads)"}
    assert (
        context_parallel_plan(dense, 4)["attention"]
        == "ulysses (4 heads / 4 ranks, 2 KV heads replicated x2)"
    )
    assert context_parallel_plan(dense, 3)["attention"].startswith("ring (4 heads")
    hybrid = load_model("tiny-qwen3.5", vocab_size=64)
    plan = context_parallel_plan(hybrid, 4)
    assert plan["gated_delta"] == "ulysses (4 value heads / 4 ranks, 2 key heads replicated x2)"
    with pytest.raises(
        ValueError, match=r"Qwen3_5GatedDeltaNet\(layer_idx=0\) has 4 value heads, which do not divide"
    ):
        context_parallel_plan(hybrid, 3, "ring")


def test_enable_needs_varpack_attention_first():
    model = load_model("tiny-qwen3", vocab_size=64, attn_backend=None)
    with pytest.raises(ValueError, match="enable_varpack"):
        enable_context_parallel(model, None)


def test_a_shard_reaching_a_model_without_context_parallelism_is_refused():
    model = load_model("tiny-qwen3", vocab_size=256, attn_backend="reference")
    shard = shard_batch(_batch(), 0, 2)
    inputs = {k: v for k, v in shard.items() if k not in NOT_MODEL_INPUTS}
    with pytest.raises(PackingGuardError, match="context parallelism is not enabled on it"):
        model(**inputs)
    unbounded = {k: v for k, v in inputs.items() if k not in ("varlen_meta", "cu_seq_lens_q", "cu_seq_lens_k",
                                                              "max_length_q", "max_length_k")}  # fmt: skip
    with pytest.raises(PackingGuardError, match="without the row's boundaries"):
        model(**unbounded)


def test_objective_refusals_before_the_model_runs():
    from varpack.train.objectives import get_objective

    shard = shard_batch(_batch(), 0, 2)
    sft = get_objective("sft")
    with pytest.raises(ValueError, match="loss_reduction='sample' with context parallelism"):
        sft.loss(None, shard, reduction="sample", num_items_in_batch=3)
    with pytest.raises(ValueError, match="loss_impl='linear_ce' with context parallelism"):
        sft.loss(None, shard, linear_ce=True, num_items_in_batch=3)
    with pytest.raises(ValueError, match="needs num_items_in_batch"):
        sft.loss(None, shard)
    assert int(sft.count_items(shard, reduction="token")) == int((shard["shift_labels"] != -100).sum())


def test_config_fields_flags_and_refusals():
    from typing import get_type_hints

    from varpack.cli.main import build_parser
    from varpack.train.cli_flags import config_from_args

    hints = get_type_hints(SFTConfig)
    assert literal_choices(hints["context_parallel_attention"]) == CONTEXT_PARALLEL_ATTENTION
    args = build_parser().parse_args(
        ["sft", "--context-parallel", "2", "--context-parallel-attention", "ring"]
    )
    config = config_from_args(args)
    assert config.context_parallel == 2 and config.context_parallel_attention == "ring"
    for bad, name in (
        ({"loss_reduction": "sample"}, "--loss-reduction sample"),
        ({"loss_impl": "linear_ce"}, "--loss-impl linear_ce"),
        ({"objective": "dpo"}, "--objective dpo"),
        ({"streaming": True, "max_steps": 2}, "--streaming"),
        ({"cuda_graphs": True}, "--cuda-graphs"),
        ({"torch_compile": True}, "--torch-compile"),
    ):
        with pytest.raises(ValueError, match=rf"--context-parallel 2 \(context_parallel=2\) with {name} "):
            check_context_parallel(SFTConfig(context_parallel=2, **bad))
    check_context_parallel(SFTConfig(context_parallel=2, torch_compile=False), world_size=4)
    with pytest.raises(ValueError, match="needs a world size that it divides"):
        check_context_parallel(SFTConfig(context_parallel=2), world_size=3)
    with pytest.raises(ValueError, match="context_parallel has an invalid value: 0"):
        SFTConfig(context_parallel=0)


def test_build_sft_refuses_a_world_that_context_parallel_does_not_divide(tmp_path, monkeypatch):
    from varpack.train import build_sft

    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(
        ValueError,
        match=r"--context-parallel 2 \(context_parallel=2\) needs a world size that it divides .* got 1 process:",
    ):
        build_sft(SFTConfig(context_parallel=2, output_dir=str(tmp_path), save=False))
