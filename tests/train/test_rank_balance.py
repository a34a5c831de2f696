"""Packs per rank: cost balance, every sample once per epoch across ranks, resume on another world size,
the masked filler pack, Trainer checkpoints. The 2-rank gloo runs are in test_ddp_gloo.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from varpack.data.dataset import PackedDataset
from varpack.data.sampler import BalancedPackSampler, MaskedPack
from varpack.plan import plan_packs
from varpack.plan.balance import (
    attention_cost_weight,
    epoch_layout,
    layout_imbalance,
    pack_costs,
    pack_membership_fingerprint,
)


def lognormal_plan(n=20000, packing_length=8192, seed=0):
    """A realistic SFT length mix: lognormal (median ~400 tokens, long tail up to packing_length)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(6.0, 1.0, n).astype(np.int64), 1, packing_length)
    return plan_packs(lengths, packing_length, seed=seed)


#: Qwen3-0.6B's attention weight (attention_cost_weight of its config; checked against the model's own
#: linear layers in test_attention_weight_counts_the_models_linear_layers on the tiny model)
QWEN3_06B_WEIGHT = 28 * 16 * 128 / (28 * (2 * 1024 * 2048 + 2 * 1024 * 1024 + 3 * 1024 * 3072) + 1024 * 151936)


@pytest.mark.parametrize("world_size,packs_per_rank", [(2, 1), (2, 4), (4, 1), (8, 2)])
def test_balanced_layout_is_within_5_percent(world_size, packs_per_rank):
    plan = lognormal_plan()
    costs = pack_costs(plan, QWEN3_06B_WEIGHT)
    assert costs.max() / costs.min() > 1.5  # the mix really has packs of very different cost
    kw = dict(world_size=world_size, packs_per_rank=packs_per_rank, seed=0, epoch=0)
    balanced = epoch_layout(plan.pack_order(0), costs, balance=True, **kw)
    plain = epoch_layout(plan.pack_order(0), costs, balance=False, **kw)
    got = layout_imbalance(balanced, costs)["imbalance"]
    assert got <= 1.05
    # control: the same packs dealt in random order wait longer at the all-reduce
    assert layout_imbalance(plain, costs)["imbalance"] > got
    for lay in (balanced, plain):
        ids = np.sort(lay[lay >= 0])
        assert np.array_equal(ids, np.arange(plan.num_packs))


def test_pack_costs_are_tokens_plus_weighted_squares():
    plan = plan_packs([5, 3, 7, 2], 10, seed=0)
    got = pack_costs(plan, 0.5)
    for p in range(plan.num_packs):
        lengths = [int(plan.item_lengths[i]) for i in range(plan.offsets[p], plan.offsets[p + 1])]
        assert got[p] == sum(lengths) + 0.5 * sum(v * v for v in lengths)
    with pytest.raises(ValueError, match="attention_weight"):
        pack_costs(plan, -1.0)


def test_attention_weight_counts_the_models_linear_layers():
    """attention_cost_weight == (layers x H x D) / (multiply-adds per token of every nn.Linear of the model)."""
    from varpack.models import load_model

    model = load_model("tiny-qwen3", attn_backend=None)
    cfg = model.config
    macs = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    expected = cfg.num_hidden_layers * cfg.num_attention_heads * head_dim / macs
    assert attention_cost_weight(cfg) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="hidden_size"):
        attention_cost_weight(object())


@pytest.mark.parametrize(
    "name,attention_layers",
    [("tiny-bamba", 1), ("tiny-granite4-hybrid", 1), ("tiny-nemotron-h", 1), ("tiny-falcon-h1", 2),
     ("tiny-zamba2", 2)],
)  # fmt: skip
def test_attention_weight_counts_only_the_attention_layers_of_a_hybrid(name, attention_layers):
    """Mamba-2 mixers, MLP and MoE blocks cost per token; only the layers with softmax attention (Falcon-H1 and
    Zamba2 "hybrid": attention beside / before a mixer) cost per pair: the weight is theirs over all layers
    of the same config read as attention in every layer."""
    from types import SimpleNamespace

    from varpack.models import model_config

    cfg = model_config(name).get_text_config()
    read = ("hidden_size", "num_attention_heads", "num_hidden_layers", "head_dim", "num_key_value_heads",
            "intermediate_size", "num_experts_per_tok", "moe_intermediate_size", "vocab_size")  # fmt: skip
    every_layer = SimpleNamespace(**{k: getattr(cfg, k, None) for k in read})
    ratio = attention_cost_weight(cfg) / attention_cost_weight(every_layer)
    assert ratio == pytest.approx(attention_layers / cfg.num_hidden_layers, rel=1e-12)


def test_attention_weight_of_a_model_without_attention_is_zero():
    """Pure Mamba-2 has no attention heads and no attention layer: weight 0, nothing to read; a layer type of
    unknown cost is refused by name."""
    from types import SimpleNamespace

    from varpack.models import model_config

    assert attention_cost_weight(model_config("tiny-mamba2")) == 0.0
    assert attention_cost_weight(SimpleNamespace(layer_types=["linear_attention", "mlp", "moe"])) == 0.0
    with pytest.raises(ValueError, match="'mystery'"):
        attention_cost_weight(SimpleNamespace(layer_types=["full_attention", "mystery"]))


@pytest.mark.parametrize("world_size,balance", [(1, True), (2, False), (2, True)])
def test_pack_sampler_needs_the_attention_weight_only_to_balance_ranks(world_size, balance):
    """A config that does not give the attention cost: one rank or round-robin lay out without it (weight 0);
    the cost-balanced layout of several ranks refuses, asking for the weight."""
    from types import SimpleNamespace

    from varpack.train.trainer import make_pack_sampler

    plan = plan_packs([5, 3, 7, 2, 9, 4], 10, seed=0)
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=8))
    args = SimpleNamespace(process_index=0, world_size=world_size, gradient_accumulation_steps=1)
    make = lambda: make_pack_sampler(plan, model, args, packs_per_rank=1, balance=balance)  # noqa: E731
    if balance and world_size > 1:
        with pytest.raises(ValueError, match="attention_cost_weight"):
            make()
    else:
        assert make().attention_weight == 0.0
    assert make_pack_sampler(plan, model, args, packs_per_rank=1, attention_weight=0.5).attention_weight == 0.5


def _epoch_ids(plan, world_size, packs_per_rank, epoch=0, state=None, grad_accum=1):
    """Per rank: the micro-batches (lists of pack ids / MaskedPack) of one epoch."""
    out = []
    for rank in range(world_size):
        s = BalancedPackSampler(
            plan, rank=rank, world_size=world_size, packs_per_rank=packs_per_rank, grad_accum=grad_accum,
            attention_weight=1e-3,
        )  # fmt: skip
        if state is not None:
            s.load_state_dict(state)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


def _samples_of(plan, batches):
    """Sample ids trained by micro-batches (MaskedPack fillers train nothing)."""
    ids = []
    for batch in batches:
        for p in batch:
            if not isinstance(p, MaskedPack):
                ids += plan.pack(p).tolist()
    return ids


@pytest.mark.parametrize("world_size,packs_per_rank", [(1, 1), (2, 1), (2, 3), (3, 2), (4, 1)])
def test_every_sample_once_per_epoch_across_ranks(world_size, packs_per_rank):
    rng = np.random.default_rng(1)
    plan = plan_packs(rng.integers(1, 60, 97), 64, seed=3)
    for epoch in (0, 1):
        per_rank = _epoch_ids(plan, world_size, packs_per_rank, epoch=epoch)
        assert len({len(b) for b in per_rank}) == 1  # every rank steps the same number of micro-batches
        ids = sorted(i for rank in per_rank for i in _samples_of(plan, rank))
        assert ids == list(range(plan.num_samples))
        fillers = [p for rank in per_rank for b in rank for p in b if isinstance(p, MaskedPack)]
        rest = plan.num_packs % (world_size * packs_per_rank)
        assert len(fillers) == (max(0, world_size - rest) if rest else 0)
        assert all(len(b) <= packs_per_rank for rank in per_rank for b in rank)
    # the order changes with the epoch, the packs do not
    assert _epoch_ids(plan, world_size, packs_per_rank, 0) != _epoch_ids(plan, world_size, packs_per_rank, 1)


@pytest.mark.parametrize("resume_world_size", [1, 2, 3])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_resume_mid_epoch_on_any_world_size_trains_the_rest_once(resume_world_size, grad_accum):
    rng = np.random.default_rng(2)
    plan = plan_packs(rng.integers(1, 60, 151), 64, seed=5)
    epoch, k = 1, 3  # stop after 3 optimizer steps of epoch 1 on 2 ranks
    first = _epoch_ids(plan, 2, 1, epoch=epoch, grad_accum=grad_accum)
    done = [i for rank in first for i in _samples_of(plan, rank[: k * grad_accum])]
    s = BalancedPackSampler(plan, rank=0, world_size=2, grad_accum=grad_accum, attention_weight=1e-3, epoch=epoch)
    state = json.loads(json.dumps(s.state_dict(consumed_steps=k)))  # through JSON, as in a checkpoint
    rest = _epoch_ids(plan, resume_world_size, 2, epoch=epoch, state=state, grad_accum=grad_accum)
    again = [i for rank in rest for i in _samples_of(plan, rank)]
    assert sorted(done + again) == list(range(plan.num_samples))  # each remaining sample exactly once
    assert len(done) > 0 and len(again) > 0
    # resumed twice (2 ranks -> resume_world_size -> 2 ranks): still exactly the rest
    r0 = BalancedPackSampler(plan, rank=0, world_size=resume_world_size, packs_per_rank=2, attention_weight=1e-3)
    r0.load_state_dict(state)
    state2 = r0.state_dict(consumed_steps=1)
    step2 = [i for rank in rest for i in _samples_of(plan, rank[:1])]
    third = _epoch_ids(plan, 2, 1, epoch=epoch, state=state2)
    tail = [i for rank in third for i in _samples_of(plan, rank)]
    assert sorted(done + step2 + tail) == list(range(plan.num_samples))
    # the next epoch is whole again
    r0.set_epoch(epoch + 1)
    assert r0.remaining_packs().size == plan.num_packs


def test_resume_refuses_another_plan_or_cost_model():
    plan = plan_packs([5, 3, 7, 2, 9], 10, seed=0)
    state = BalancedPackSampler(plan, world_size=1, attention_weight=0.1).state_dict(consumed_steps=1)
    with pytest.raises(ValueError, match="attention_weight"):
        BalancedPackSampler(plan, attention_weight=0.2).load_state_dict(state)
    other = plan_packs([5, 3, 7, 2, 8], 10, seed=0)
    with pytest.raises(ValueError, match="plan_fingerprint"):
        BalancedPackSampler(other, attention_weight=0.1).load_state_dict(state)
    with pytest.raises(ValueError, match="not a varpack-pack-sampler"):
        BalancedPackSampler(plan).load_state_dict({"epoch": 0})


def test_fingerprint_sees_membership_and_layout():
    a = plan_packs([5, 3, 7, 2, 9], 10, seed=0)
    b = plan_packs([5, 3, 7, 2, 9], 10, strategy="sequential", seed=0)
    assert pack_membership_fingerprint(a) == pack_membership_fingerprint(plan_packs([5, 3, 7, 2, 9], 10))
    assert pack_membership_fingerprint(a) != pack_membership_fingerprint(b)
    s = dict(world_size=2, attention_weight=0.1)
    assert BalancedPackSampler(a, rank=0, **s).fingerprint() == BalancedPackSampler(a, rank=1, **s).fingerprint()
    assert BalancedPackSampler(a, **s).fingerprint() != BalancedPackSampler(a, world_size=2).fingerprint()


def test_masked_filler_pack_trains_and_counts_nothing():
    from varpack.collate import PaddingFreeCollator
    from varpack.loss import count_loss_items_tensor
    from varpack.train.trainer import TrainCollator

    samples = [
        {"input_ids": list(range(1, 1 + n)), "labels": [-100] + list(range(2, 1 + n)), "length": n}
        for n in (4, 6, 3)
    ]
    ds = PackedDataset(samples, plan_packs([4, 6, 3], 8), shuffle=False)
    collate = TrainCollator(PaddingFreeCollator())
    real, masked = collate([ds[0]]), collate([ds[MaskedPack(0)]])
    assert torch.equal(real["input_ids"], masked["input_ids"])  # the same tokens run...
    assert (masked["labels"] == -100).all() and masked["sample_ids"] == [None] * len(real["sample_ids"])
    assert masked["batch_stats"] == dict.fromkeys(real["batch_stats"], 0)  # ...and count for nothing
    for reduction in ("token", "sample"):
        assert int(count_loss_items_tensor(masked["labels"], reduction=reduction, seq_idx=masked["seq_idx"])) == 0
        assert int(count_loss_items_tensor(real["labels"], reduction=reduction, seq_idx=real["seq_idx"])) > 0


# -- Trainer: checkpoint, resume_from_checkpoint (one process) ---------------------------------------------


def _record_trained(trainer, seen):
    """Record the sample ids of every micro-batch the Trainer trains on (not the ones accelerate prefetches)."""
    step = trainer.training_step

    def training_step(model, inputs, *args, **kwargs):
        seen.append([s for s in inputs["sample_ids"] if s is not None])
        return step(model, inputs, *args, **kwargs)

    trainer.training_step = training_step


def _trainer_run(tmp_path, seen, save_steps=3, **cfg):
    from tests.train.test_cli_sft import _build

    kw = dict(packing_length=32, epochs=2, lr=1e-3, grad_accum=2, save=False)
    kw.update(cfg)
    extra = {"optim": "sgd", "max_grad_norm": 0.0, "use_cpu": True, "save_strategy": "steps"}
    extra["save_steps"] = save_steps
    run = _build(tmp_path, extra_training_args=extra, **kw)
    _record_trained(run.trainer, seen)
    return run


def test_trainer_resume_trains_each_remaining_sample_once(tmp_path):
    """Stop after the first step of epoch 1 (a checkpoint there), resume with resume_from_checkpoint: the
    micro-batches of the uninterrupted run, every sample once per epoch, nothing skipped twice."""
    full: list = []
    run = _trainer_run(tmp_path / "full", full)
    per_epoch = len(run.trainer.pack_sampler) // 2 + len(run.trainer.pack_sampler) % 2
    assert per_epoch >= 2
    run.trainer.train()
    n = run.plan.num_samples
    assert sorted(i for b in full for i in b) == sorted(list(range(n)) * 2)  # 2 epochs, each sample twice

    first: list = []
    stop = per_epoch + 1  # mid-epoch 1
    run1 = _trainer_run(tmp_path, first, max_steps=stop, save_steps=stop)
    run1.trainer.train()
    ckpt = tmp_path / "out" / f"checkpoint-{stop}"
    state = json.loads((ckpt / "varpack_sampler.json").read_text())
    assert state["epoch"] == 1 and state["segments"] == [[1, 1, 2, 1]]
    second: list = []
    run2 = _trainer_run(tmp_path, second)
    run2.trainer.train(resume_from_checkpoint=str(ckpt))
    assert first + second == full  # the same micro-batches in the same order: resumed exactly
    trained = sorted(i for b in first + second for i in b)
    assert trained == sorted(list(range(n)) * 2)

    # a checkpoint of another layout is refused before training (Trainer would skip the wrong packs)
    run3 = _trainer_run(tmp_path, [], grad_accum=1)
    with pytest.raises(ValueError, match="grad_accum=2"):
        run3.trainer.train(resume_from_checkpoint=str(ckpt))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_fsdp_without_gpu_is_refused_before_encoding(tmp_path):
    """accelerate shards only on GPUs and would run plain DDP on CPUs: refused, not silently ignored."""
    from varpack.train import SFTConfig, build_sft

    with pytest.raises(ValueError, match="fsdp needs CUDA GPUs"):
        build_sft(SFTConfig(fsdp=True, output_dir=str(tmp_path / "out"), data=("missing.jsonl",)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_accelerate_use_fsdp_without_gpu_is_refused(tmp_path, monkeypatch):
    """`accelerate launch --use_fsdp` sets ACCELERATE_USE_FSDP; on CPUs accelerate would run plain DDP under it:
    refused like --fsdp (and not when the variable is off)."""
    from varpack.train import SFTConfig, build_sft

    cfg = SFTConfig(output_dir=str(tmp_path / "out"), data=("missing.jsonl",))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="ACCELERATE_USE_FSDP"):
        build_sft(cfg)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    with pytest.raises(Exception) as info:  # goes on to read the data: fails on the missing file instead
        build_sft(cfg)
    assert "ACCELERATE_USE_FSDP" not in str(info.value)
