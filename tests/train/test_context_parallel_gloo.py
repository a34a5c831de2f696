"""Context parallelism on CPU ranks over gloo: a packed row split over a context-parallel group (and beside
data parallelism, world = dp x cp) equals the one-process step: logits, loss and every parameter's gradient,
for tiny-qwen3 (dense attention), tiny-qwen3.5 (Gated DeltaNet: short convolution and gated delta rule over
head shards) and tiny-qwen3-vl (the vision tower before the split, DeepStack rows, mRoPE planes cut with the
tokens); Ulysses and ring attention; negative controls that must fail the same comparison: labels shifted
after the split, boundaries ignored by the split's attention (one segment over the row; the ring's mask
without documents), positions restarted per shard instead of cut with the tokens; FSDP2 (``fully_shard`` by
hand: accelerate shards only on GPUs) around the split. The Trainer path
(``build_sft(SFTConfig(context_parallel=...))``: sampler over the data-parallel replicas, the collator's split,
the global token count, DDP over the world) against the one-process Trainer step, and the CLI
(``varpack check --context-parallel 2`` prints PASS, ``varpack sft --context-parallel 2`` trains).

Two launches (torchrun): 2 ranks (cp=2) and 4 ranks (cp=4, dp=2 x cp=2); every configuration of a launch shares
its process group. Tolerances are relative to each tensor's scale: ``max|a - b| <= RTOL * max|b| + ATOL``.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch

from tests import _launch as launch
from varpack.collate import PaddingFreeCollator, shard_batch
from varpack.loss import causal_lm_loss, shifted_lm_loss
from varpack.models import load_model
from varpack.schema import CP_SHARD, IGNORE_INDEX, NOT_MODEL_INPUTS, SHIFT_LABELS

VOCAB = 512
#: relative tolerance of every comparison, and the absolute floor (fp32 summation-order noise: the cancelling
#: gradient of a Gated DeltaNet dt_bias, max|g| ~2e-6, differs by ~7e-10 between cp=4 and one process)
RTOL, ATOL = 1e-4, 1e-8
#: two packs at packing_length 32 (best-fit decreasing): {20, 12}, {18, 10}
LENGTHS = (20, 12, 18, 10)
TEXT_MODELS = ("tiny-qwen3", "tiny-qwen3.5")
MODELS = TEXT_MODELS + ("tiny-qwen3-vl",)


def text_samples(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        cut = max(1, n // 3)
        out.append({"input_ids": ids, "labels": [-100] * cut + ids[cut:], "length": n})
    return out


def vl_packs(model):
    """Two packs of real image chats (one with two images) and a text chat, encoded for ``model``."""
    from varpack.data.media import image_processor_for
    from varpack.data.multimodal import encode_mm_chat
    from varpack.data.tokenizer import load_tokenizer
    from varpack.data.vl_builtin import package_image_path
    from varpack.models.qwen_vl import tiny_config

    def user(names, question, answer):
        content = [{"type": "image", "image": package_image_path("skimage", n)} for n in names]
        return [
            {"role": "user", "content": content + [{"type": "text", "text": question}]},
            {"role": "assistant", "content": answer},
        ]

    chats = [
        user(["astronaut.png"], "Who is this?", "An astronaut in an orange suit."),
        [{"role": "user", "content": "What is 12 times 7?"}, {"role": "assistant", "content": "84."}],
        user(["text.png", "chelsea.png"], "Describe both.", "Handwritten maths, then a cat."),
    ]
    tok = load_tokenizer("qwen3")
    proc = image_processor_for(tiny_config("tiny-qwen3-vl"), min_pixels=32 * 32, max_pixels=96 * 96)
    samples = [encode_mm_chat(c, tok, proc, sample_id=i, rope_model=model) for i, c in enumerate(chats)]
    return [samples[:2], samples[2:]]


def model_and_packs(name):
    """A tiny model (reference attention, eval mode: no dropout) and two packs of its samples."""
    if name in TEXT_MODELS:
        model = load_model(name, vocab_size=VOCAB, attn_backend="reference", seed=0)
        s = text_samples()
        packs = [[s[0], s[1]], [s[2], s[3]]]
    else:
        model = load_model(name, attn_backend="reference", seed=0)
        packs = vl_packs(model)
    return model.eval(), packs


def _inputs(batch):
    return {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def one_process(model, packs):
    """The one-process packed step: each pack's logits (its own row) and the loss / gradients of all packs in
    one row (the global token mean)."""
    collate = PaddingFreeCollator()
    with torch.no_grad():
        logits = [model(**_inputs(collate([p]))).logits[0].float() for p in packs]
    batch = collate(packs)
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss(model(**_inputs(batch)).logits, batch["labels"], seq_idx=batch["seq_idx"])
    loss.backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return logits, float(loss.detach()), grads


def _one_segment(batch):
    """The shard's boundaries replaced by one segment over the whole row (a split that ignores them)."""
    from varpack.varlen import VarlenMeta

    meta = VarlenMeta.from_lengths([batch["varlen_meta"].total_q])
    out = dict(batch)
    out.update(meta.flash_attn_kwargs(), varlen_meta=meta)
    return out


def context_parallel_step(model, packs, *, cp_group, dp_rank, attention, sabotage=None, fsdp2=False):
    """One step of this rank: data-parallel replica ``dp_rank`` trains ``packs[dp_rank]``, split over
    ``cp_group``. Returns ``(logits of the replica's row, loss, {name: gradient})``: the logits gathered over
    the group, the loss and gradients summed over the world (the global token mean's).

    ``sabotage`` (negative controls): ``"shift_after_split"`` (the loss shifts this rank's own labels),
    ``"one_segment"`` (the row's boundaries replaced by one segment), ``"positions_restart"`` (each shard's
    positions ``0..T_r-1`` instead of the row's).

    ``fsdp2``: ``model`` was sharded with ``fully_shard`` over the world (FSDP2 averages the gradients over
    the world, so the loss is multiplied by the world size, as varpack's Trainer does; the gradients are then
    the full ones, not summed again)."""
    import torch.distributed as dist

    from varpack.integrations.context_parallel import enable_context_parallel

    enable_context_parallel(model, cp_group, attention=attention)
    cp_rank, cp_size = dist.get_rank(cp_group), dist.get_world_size(cp_group)
    batch = PaddingFreeCollator()([packs[dp_rank]])
    shard = shard_batch(batch, cp_rank, cp_size)
    split = shard[CP_SHARD]
    if sabotage == "one_segment":
        shard = _one_segment(shard)
    if sabotage == "positions_restart":
        pos = shard["position_ids"]
        shard["position_ids"] = torch.arange(pos.shape[-1]).expand_as(pos).clone()
    model.zero_grad(set_to_none=True)
    logits = model(**_inputs(shard)).logits
    if sabotage == "shift_after_split":  # this rank's labels shifted as if its tokens were contiguous
        targets = split.take(batch["labels"])
        local = torch.full_like(targets, IGNORE_INDEX)
        local[:, :-1] = targets[:, 1:]
    else:
        local = shard[SHIFT_LABELS]
    count = (local != IGNORE_INDEX).sum()
    dist.all_reduce(count)  # every rank of the world: the step's supervised tokens
    loss = shifted_lm_loss(logits, local, num_items_in_batch=count)
    (loss * dist.get_world_size() if fsdp2 else loss).backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    if fsdp2:
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    else:
        grads = _grads(model)
        for g in grads.values():
            dist.all_reduce(g)
    model.zero_grad(set_to_none=True)
    local_logits = logits[0].detach().float()
    width = max(split.counts)
    padded = local_logits.new_zeros(width, local_logits.shape[-1])
    padded[: split.num_local] = local_logits
    pieces = [torch.empty_like(padded) for _ in range(cp_size)]
    dist.all_gather(pieces, padded, group=cp_group)
    whole = local_logits.new_zeros(split.total, local_logits.shape[-1])
    for r, piece in enumerate(pieces):
        whole[split.rank_index(r)] = piece[: split.counts[r]]
    return whole, float(total), grads


def worst(a, b):
    """``max|a - b| / (RTOL * max|b| + ATOL)``: <= 1 passes."""
    return float((a - b).abs().max()) / (RTOL * float(b.abs().max()) + ATOL)


def compare(got, ref, dp_rank):
    """The worst ratio (<= 1 passes) of logits, loss and gradients against the one-process step, per kind."""
    logits, loss, grads = got
    ref_logits, ref_loss, ref_grads = ref
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    return {
        "logits": worst(logits, ref_logits[dp_rank]),
        "loss": abs(loss - ref_loss) / (1e-5 * abs(ref_loss) + ATOL),
        "grads": max(worst(grads[n], ref_grads[n]) for n in ref_grads),
    }


def run_configs(configs, out):
    """Each ``(label, model, attention, variant)`` of ``configs`` on this rank (``variant``: a negative control
    of :func:`context_parallel_step`, ``"ring_without_documents"`` or ``"fsdp2"``), with the groups of
    ``world = dp x cp`` (``cp`` from the env); the comparisons written to ``out/<label>.json`` by rank 0."""
    import torch.distributed as dist

    from varpack.integrations.context_parallel import context_parallel_mesh

    cp = int(os.environ["VARPACK_TEST_CP"])
    mesh = context_parallel_mesh(cp, "cpu")
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    cache = {}
    for label, name, attention, sabotage in configs:
        if name not in cache:
            model, packs = model_and_packs(name)
            cache.clear()  # one model in memory at a time
            # the one-process step over the packs the data-parallel replicas train (one each)
            cache[name] = (model, packs, one_process(model, packs[:dp_size]))
        model, packs, ref = cache[name]
        if sabotage == "ring_without_documents":
            from varpack.attn import context_parallel as cpa

            original = cpa._block_mask

            def no_documents(pos_q, doc_q, pos_k, doc_k, causal, window, original=original):
                return original(
                    pos_q, torch.zeros_like(doc_q), pos_k, torch.zeros_like(doc_k), causal, window
                )

            cpa._block_mask = no_documents
            try:
                got = context_parallel_step(
                    model, packs, cp_group=mesh["cp"].get_group(), dp_rank=dp_rank, attention="ring"
                )
            finally:
                cpa._block_mask = original
        elif sabotage == "fsdp2":  # not a sabotage: FSDP2 (fully_shard over the world) around the split
            import copy

            from torch.distributed.fsdp import fully_shard

            sharded = copy.deepcopy(model)
            for layer in sharded.model.layers:
                fully_shard(layer)
            fully_shard(sharded)
            got = context_parallel_step(
                sharded,
                packs,
                cp_group=mesh["cp"].get_group(),
                dp_rank=dp_rank,
                attention=attention,
                fsdp2=True,
            )
        else:
            got = context_parallel_step(
                model,
                packs,
                cp_group=mesh["cp"].get_group(),
                dp_rank=dp_rank,
                attention=attention,
                sabotage=sabotage,
            )
        ratios = compare(got, ref, dp_rank)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, ratios)
        if dist.get_rank() == 0:
            (out / f"{label}.json").write_text(json.dumps(gathered))


_CONFIGS = {
    2: [(f"cp2-{m}", m, "auto", None) for m in MODELS]
    + [
        ("cp2-ring-tiny-qwen3", "tiny-qwen3", "ring", None),
        ("cp2-ring-tiny-qwen3.5", "tiny-qwen3.5", "ring", None),
        ("cp2-fsdp2-tiny-qwen3", "tiny-qwen3", "auto", "fsdp2"),
    ]
    + [
        ("control-shift_after_split", "tiny-qwen3", "auto", "shift_after_split"),
        ("control-one_segment", "tiny-qwen3", "auto", "one_segment"),
        ("control-positions_restart", "tiny-qwen3", "auto", "positions_restart"),
        ("control-ring_without_documents", "tiny-qwen3", "ring", "ring_without_documents"),
        ("control-one_segment-tiny-qwen3.5", "tiny-qwen3.5", "auto", "one_segment"),
    ],
    4: [(f"cp4-{m}", m, "auto", None) for m in MODELS]
    + [("cp4-ring-tiny-qwen3", "tiny-qwen3", "ring", None)],
}
#: dp=2 x cp=2 on the 4-rank launch (the same rows, two data-parallel replicas)
_DPCP = [(f"dp2cp2-{m}", m, "auto", None) for m in MODELS] + [
    ("control-dp2cp2-shift_after_split", "tiny-qwen3", "auto", "shift_after_split")
]


class _Tok:
    pad_token_id = 0

    def save_pretrained(self, path):
        return None


def trainer_step(out_dir, **cfg):
    """One Trainer step (SGD, lr 1, no clipping) of tiny-qwen3 on the two packs: ``{name: parameter change}``
    (= minus the step's gradient) and the logged loss."""
    from varpack.train import SFTConfig, build_sft

    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference", seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = SFTConfig(
        model="tiny-qwen3", output_dir=str(out_dir), packing_length=32, attn_backend="reference", save=False,
        max_steps=1, lr=1.0, loss_impl="logits",
        extra_training_args={"optim": "sgd", "max_grad_norm": 0.0, "use_cpu": True}, **cfg,
    )  # fmt: skip
    run = build_sft(config, model=model, tokenizer=_Tok(), encoded=text_samples())
    run.trainer.train()
    delta = {n: p.detach() - before[n] for n, p in run.model.named_parameters()}
    loss = [h["loss"] for h in run.trainer.state.log_history if "loss" in h][0]
    return run, delta, loss


_SCRIPT = r"""
import contextlib, io, json, os, pathlib, sys, torch
sys.path.insert(0, {root!r})
import torch.distributed as dist
from tests.train import test_context_parallel_gloo as t
out = pathlib.Path({out!r})
world = int(os.environ["WORLD_SIZE"])
rank = int(os.environ["RANK"])
# the Trainer path first (it opens the gloo process group through accelerate)
run, delta, loss = t.trainer_step(out / "trainer", context_parallel=2, packs_per_step=1)
if rank == 0:
    torch.save(delta, out / "trainer.pt")
    (out / "trainer.json").write_text(json.dumps({{"loss": loss, "context": run.context_parallel.describe()}}))
os.environ["VARPACK_TEST_CP"] = str(world)
t.run_configs(t._CONFIGS[world], out)
if world == 4:
    os.environ["VARPACK_TEST_CP"] = "2"
    t.run_configs(t._DPCP, out)
if world == 2:  # the CLI, in this process group; sft last (it closes the group)
    from varpack.cli.main import main
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["check", "--context-parallel", "2", "--model", "tiny-qwen3", "--num-samples", "3",
                     "--max-sample-length", "64"])
    if rank == 0:
        (out / "cli-check.json").write_text(json.dumps({{"code": code, "stdout": buf.getvalue()}}))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["sft", "--context-parallel", "2", "--max-steps", "1", "--no-save", "--packing-length", "512",
                     "--overflow", "drop", "--output-dir", str(out / "cli-sft")])
    if rank == 0:
        (out / "cli-sft.json").write_text(json.dumps({{"code": code, "stdout": buf.getvalue()}}))
else:
    from varpack.train.distributed import close_process_group
    close_process_group()
"""


def _launch(tmp_path, world):
    pytest.importorskip("PIL")
    pytest.importorskip("skimage")
    root = str(pathlib.Path(__file__).parents[2])
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT.format(root=root, out=str(tmp_path)))
    env = {**os.environ, "PYTHONPATH": root, "CUDA_VISIBLE_DEVICES": ""}
    proc = launch.run(launch.torchrun(world, script), timeout=900, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


def _ratios(tmp_path, label):
    per_rank = json.loads((tmp_path / f"{label}.json").read_text())
    return {kind: max(r[kind] for r in per_rank) for kind in per_rank[0]}


def _check_trainer(tmp_path, *, packs_per_step):
    """The Trainer step of the launch against the one-process Trainer step over the same packs."""
    _, ref, ref_loss = trainer_step(tmp_path / "ref", packs_per_step=packs_per_step)
    got = torch.load(tmp_path / "trainer.pt")
    assert set(got) == set(ref)
    ratio = max(worst(got[n], ref[n]) for n in ref)
    assert ratio <= 1, ratio
    info = json.loads((tmp_path / "trainer.json").read_text())
    assert info["loss"] == pytest.approx(ref_loss, rel=1e-5)
    return info


def test_two_gloo_ranks_context_parallel_equals_one_process(tmp_path):
    _launch(tmp_path, 2)
    for label, *_ in _CONFIGS[2]:
        ratios = _ratios(tmp_path, label)
        if label.startswith("control-"):
            # a negative control fails the same comparison, by far
            assert max(ratios.values()) > 100, (label, ratios)
        else:
            assert max(ratios.values()) <= 1, (label, ratios)
    info = _check_trainer(tmp_path, packs_per_step=1)  # cp=2, dp=1: the first pack, as one process trains it
    assert info["context"].startswith("2 ranks share each row (zigzag split; attention: ulysses"), info
    check = json.loads((tmp_path / "cli-check.json").read_text())
    assert check["code"] == 0 and check["stdout"].rstrip().endswith("PASS"), check["stdout"]
    assert "context parallel: the row split over 2 ranks" in check["stdout"]
    sft = json.loads((tmp_path / "cli-sft.json").read_text())
    assert sft["code"] == 0 and "done: 1 steps" in sft["stdout"], sft["stdout"][-3000:]
    assert "context   2 ranks share each row" in sft["stdout"]


def test_four_gloo_ranks_cp4_and_dp2_x_cp2_equal_one_process(tmp_path):
    _launch(tmp_path, 4)
    for label, *_ in _CONFIGS[4] + _DPCP:
        ratios = _ratios(tmp_path, label)
        if label.startswith("control-"):
            assert max(ratios.values()) > 100, (label, ratios)
        else:
            assert max(ratios.values()) <= 1, (label, ratios)
    # the Trainer: dp=2 x cp=2, one pack per replica = both packs, as one process with 2 packs per step
    _check_trainer(tmp_path, packs_per_step=2)
