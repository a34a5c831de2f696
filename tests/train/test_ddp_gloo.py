"""`varpack sft` under torchrun, 2 CPU ranks over gloo: one DDP step over the rank-balanced packs equals
the one-process step over the same packs (loss and every parameter's gradient, as the SGD step at lr 1), for
the token mean and the sample mean, with a negative control (per-rank means: average_tokens_across_devices
off); the same for FSDP2 (``fully_shard`` per decoder layer and the root; accelerate shards only on GPUs, so
here the step is driven by hand over the same sampler, collator and objective); and ranks that planned
different packs are refused before training."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

from tests import _launch as launch
from varpack.models import load_model
from varpack.train import SFTConfig, build_sft
from varpack.train.trainer import EngineReportCallback, SpeedReportCallback

VOCAB = 512
#: packing_length 32: best-fit decreasing makes 3 packs ({25, 5}, {20, 12}, {18, 10}): 2 ranks x 1 pack per
#: micro-batch x 2 micro-batches = 4 places, so rank 1's second micro-batch is the masked filler pack
LENGTHS = (20, 12, 18, 10, 25, 5)


def samples(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        cut = max(1, n // 3)
        out.append({"input_ids": ids, "labels": [-100] * cut + ids[cut:], "length": n})
    return out


class _Tok:
    pad_token_id = 0

    def save_pretrained(self, path):
        return None


def one_step(out_dir, *, encoded=None, **cfg):
    """One SGD step (lr 1, no clipping) of tiny-qwen3: ``(run, {name: parameter change}, logged loss)``."""
    kw = dict(
        model="tiny-qwen3",
        output_dir=str(out_dir),
        packing_length=32,
        attn_backend="reference",
        save=False,
        max_steps=1,
        lr=1.0,
        loss_impl="logits",
    )
    extra = {"optim": "sgd", "max_grad_norm": 0.0, "use_cpu": True}
    extra.update(cfg.pop("extra", {}))
    kw.update(cfg)
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    run = build_sft(
        SFTConfig(extra_training_args=extra, **kw), model=model, tokenizer=_Tok(),
        encoded=encoded if encoded is not None else samples(),
    )  # fmt: skip
    run.trained_ids = []  # sample ids of the micro-batches this rank trained (fillers have none)
    run.engines = []  # what varpack sft prints as its engine line (main process only)
    run.trainer.add_callback(EngineReportCallback(run.engines.append))
    run.speed = []  # its speed line (main process only)
    run.trainer.add_callback(SpeedReportCallback(run.trainer, run.compile_choice, print_fn=run.speed.append))
    step = run.trainer.training_step

    def training_step(model, inputs, *args, **kwargs):
        run.trained_ids += [i for i in inputs["sample_ids"] if i is not None]
        return step(model, inputs, *args, **kwargs)

    run.trainer.training_step = training_step
    run.trainer.train()
    delta = {n: p.detach() - before[n] for n, p in run.model.named_parameters()}
    loss = [h["loss"] for h in run.trainer.state.log_history if "loss" in h][0]
    return run, delta, loss


def fsdp2_step(reduction, *, global_items=True, compile_backend=None):
    """One FSDP2 step on this rank (process group up): ``({name: full gradient}, global loss)``.

    The rank's micro-batches of :class:`BalancedPackSampler` (2 ranks x 2 micro-batches, as ``one_step``
    with ``grad_accum=2``), the loss divided by the step's item count summed over ranks (``global_items``;
    ``False``: this rank's own count, the negative control) and multiplied by the world size, as
    ``PackedLossMixin.compute_loss`` does, because FSDP2 averages the gradients over ranks. With
    ``compile_backend`` the decoder layers are compiled (:func:`varpack.integrations.kernels.compile_layers`
    with that backend) before they are sharded, the order of ``varpack sft --fsdp`` (the layers are compiled
    as the model is prepared, accelerate shards them when the Trainer starts)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from varpack.collate import PaddingFreeCollator
    from varpack.data.dataset import PackedDataset
    from varpack.data.sampler import BalancedPackSampler
    from varpack.plan.balance import attention_cost_weight
    from varpack.train.objectives import get_objective
    from varpack.train.sft import plan_samples
    from varpack.train.trainer import TrainCollator

    rank, world = dist.get_rank(), dist.get_world_size()
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    encoded = samples()
    _, plan = plan_samples(encoded, packing_length=32)
    sampler = BalancedPackSampler(
        plan, rank=rank, world_size=world, grad_accum=2, attention_weight=attention_cost_weight(model.config)
    )
    dataset = PackedDataset(encoded, plan, shuffle=False)
    collate = TrainCollator(PaddingFreeCollator(pad_token_id=0))
    batches = [collate([dataset[p] for p in micro]) for micro in sampler]
    if compile_backend is not None:
        from varpack.integrations import kernels

        kernels.compile_layers(model, backend=compile_backend)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    from varpack.train.trainer import _is_fully_sharded

    assert _is_fully_sharded(model)  # what makes PackedLossMixin take the logits path under FSDP2
    from varpack.train.trainer import describe_engine

    units = len(model.model.layers) + 1  # every decoder layer and the root
    assert describe_engine(model, world) == f"FSDP2 (fully_shard, {units} units) on {world} ranks"
    objective = get_objective("sft")
    items = sum(objective.count_items(b, reduction=reduction) for b in batches)
    if global_items:
        dist.all_reduce(items)
    total = torch.zeros(())
    for batch in batches:
        loss = objective.loss(model, batch, reduction=reduction, num_items_in_batch=items).loss
        (loss * world).backward()
        total += loss.detach()
    dist.all_reduce(total)
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}, float(total)


def trained_ids_with_resume(out_dir):
    """2 ranks, 8 samples -> 5 packs (3 micro-batch slots, one filler): ``(ids trained by an uninterrupted
    epoch, ids of a run stopped after step 1 (checkpoint), ids of the run resumed from that checkpoint)``,
    this rank's, each a list of micro-batches' sample ids."""
    lengths = (30, 7, 22, 9, 17, 14, 26, 5)
    out = []
    for name, cfg, resume in (
        ("full", {}, None),
        ("first", {"max_steps": 1}, None),
        ("second", {}, "first/checkpoint-1"),
    ):
        model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
        extra = {"optim": "sgd", "use_cpu": True, "save_strategy": "steps", "save_steps": 1}
        config = SFTConfig(
            model="tiny-qwen3", output_dir=str(out_dir / ("first" if resume else name)), packing_length=32,
            attn_backend="reference", save=False, lr=1e-3, extra_training_args=extra, **cfg,
        )  # fmt: skip
        run = build_sft(config, model=model, tokenizer=_Tok(), encoded=samples(lengths))
        seen = []
        step = run.trainer.training_step

        def training_step(model, inputs, *args, _step=step, _seen=seen, **kwargs):
            _seen.append([i for i in inputs["sample_ids"] if i is not None])
            return _step(model, inputs, *args, **kwargs)

        run.trainer.training_step = training_step
        run.trainer.train(resume_from_checkpoint=str(out_dir / resume) if resume else None)
        out.append(seen)
    return out


_SCRIPT = r"""
import json, pathlib, sys, torch
sys.path.insert(0, {root!r})
from tests.train.test_ddp_gloo import one_step, samples, LENGTHS
out = pathlib.Path({out!r})
rank = int(__import__("os").environ["RANK"])
result = {{}}
for name, reduction, extra in [
    ("token", "token", {{}}),
    ("sample", "sample", {{}}),
    ("control", "token", {{"average_tokens_across_devices": False}}),
]:
    run, delta, loss = one_step(out / name, loss_reduction=reduction, grad_accum=2, extra=extra)
    layout = run.trainer.pack_sampler.layout().tolist()
    if rank == 0:
        torch.save(delta, out / f"{{name}}.pt")
    result[name] = {{"loss": loss, "layout": layout, "ids": run.trained_ids, "engine": run.engines}}
from tests.train.test_ddp_gloo import fsdp2_step
for name, reduction, global_items in [
    ("fsdp-token", "token", True), ("fsdp-sample", "sample", True), ("fsdp-control", "token", False)
]:
    grads, loss = fsdp2_step(reduction, global_items=global_items)
    if rank == 0:
        torch.save({{n: -g for n, g in grads.items()}}, out / f"{{name}}.pt")  # the SGD step at lr 1
    result[name] = {{"loss": loss}}
from tests.train.test_ddp_gloo import trained_ids_with_resume
result["resume"] = trained_ids_with_resume(out / "resume")
# a rank that planned other packs (one sample one token longer) must be refused before training
try:
    lengths = list(LENGTHS)
    lengths[0] += rank
    one_step(out / "mismatch", encoded=samples(lengths), max_steps=1)
    result["mismatch"] = None
except RuntimeError as e:
    result["mismatch"] = str(e)
(out / f"result{{rank}}.json").write_text(json.dumps(result))
from varpack.train.distributed import close_process_group
close_process_group()
"""


def test_ddp_and_fsdp2_two_gloo_ranks_step_equals_one_process_step(tmp_path):
    results = launch.run_ranks(_SCRIPT, tmp_path)

    # the layout: every pack once over 2 ranks x 2 micro-batches, one masked filler place
    layout = results[0]["token"]["layout"]
    assert results[1]["token"]["layout"] == layout
    flat = [p for slot in layout for rank in slot for p in rank]
    assert sorted(p for p in flat if p >= 0) == [0, 1, 2] and flat.count(-1) == 1
    # the engine line varpack sft prints: DDP (accelerate's MULTI_CPU), on the main process only
    assert results[0]["token"]["engine"] == ["engine    DDP on 2 ranks"] and results[1]["token"]["engine"] == []
    # the step is the whole epoch: each sample trained by exactly one rank, once
    for name in ("token", "sample", "control"):
        assert sorted(results[0][name]["ids"] + results[1][name]["ids"]) == list(range(len(LENGTHS)))

    for reduction in ("token", "sample"):
        # one process, the same 3 packs in one row: the reference step
        _, ref, ref_loss = one_step(tmp_path / f"ref-{reduction}", loss_reduction=reduction, packs_per_step=3)
        scale = max(v.abs().max().item() for v in ref.values())
        assert scale > 1e-3
        for engine, control in ((reduction, "control"), (f"fsdp-{reduction}", "fsdp-control")):
            got = torch.load(tmp_path / f"{engine}.pt")
            assert set(got) == set(ref)
            worst = max((got[n] - ref[n]).abs().max().item() for n in ref)
            assert worst <= 1e-6 + 1e-5 * scale, (engine, worst, scale)
            assert results[0][engine]["loss"] == pytest.approx(ref_loss, rel=1e-5), engine
            assert results[1][engine]["loss"] == results[0][engine]["loss"]
            if reduction == "token":  # negative control: per-rank token means, averaged over ranks, differ
                wrong = torch.load(tmp_path / f"{control}.pt")
                off = max((wrong[n] - ref[n]).abs().max().item() for n in ref)
                assert off > 100 * (1e-6 + 1e-5 * scale), control

    # resume_from_checkpoint on 2 ranks: the resumed run trains the uninterrupted run's remaining micro-batches
    full, first, second = ([b for r in range(2) for b in results[r]["resume"][i]] for i in range(3))
    for r in range(2):
        f, a, b = results[r]["resume"]
        assert a + b == f and len(a) == 1 and len(b) >= 1
    assert sorted(i for batch in first + second for i in batch) == list(range(8)) == sorted(i for b in full for i in b)

    for r in range(2):
        msg = results[r]["mismatch"]
        assert msg is not None and "differs across ranks" in msg and "rank 0:" in msg and "rank 1:" in msg


def test_accelerate_launch_two_cpu_ranks_runs_ddp(tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2 -m varpack.cli.main sft` (accelerate's launcher; on
    CPUs it runs gloo): the run trains, prints the DDP engine line once, and leaves no empty output folder."""
    pytest.importorskip("accelerate")
    cmd = launch.accelerate_launch(
        2, "--mixed_precision", "no", "--dynamo_backend", "no",
        "-m", "varpack.cli.main", "sft", "--max-steps", "1", "--no-save", "--packing-length", "2048",
        "--overflow", "drop",
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).parents[2]), "CUDA_VISIBLE_DEVICES": ""}
    proc = launch.run(cmd, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout + proc.stderr
    assert out.count("engine    DDP on 2 ranks") == 1, out[-3000:]
    # the speed line names what the DDP-wrapped model runs: the logits loss (linear CE needs it unwrapped)
    speed = [line for line in out.splitlines() if line.startswith("speed")]
    assert speed == [
        "speed     eager + CE on the logits (auto: CPU run; compiled by default on CUDA only; logits: loss_impl "
        "auto: the model is wrapped (DistributedDataParallel)); CUDA graphs off (auto: CPU run; CUDA graphs need a "
        "CUDA GPU)"
    ], speed
    assert "done: 1 steps" in out
    assert not (tmp_path / "varpack-sft").exists()
