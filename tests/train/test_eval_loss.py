"""The evaluation loss does not depend on how the eval set was packed: ``evaluate()`` of varpack's
PackedSFTTrainer (``build_sft``) and of the TRL drop-in (``VarpackSFTTrainer``) reports the global token mean
(``loss_reduction="token"``) or the mean of sample means (``"sample"``) over the whole eval set, equal to the
value of every sample run alone, for three pack layouts (packing length x eval batch size). Negative control:
Trainer's own reduction (the mean of per-batch means, what ``evaluate()`` reported before) on the same batches
differs from it."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests import _launch as launch
from tests._exact import LOSS_RTOL, assert_exact, measure
from varpack.loss import causal_lm_loss
from varpack.models import load_model

VOCAB = 512
#: 24 eval samples, 3 to 40 tokens, a prompt part of a third (unsupervised)
EVAL_LENGTHS = tuple(3 + (11 * i + 5) % 38 for i in range(24))
#: (packing length, per_device_eval_batch_size): each gives other batches of other token counts
LAYOUTS = [(48, 1), (64, 2), (128, 3)]


def samples(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        cut = max(1, n // 3)
        out.append({"input_ids": ids, "labels": [-100] * cut + ids[cut:], "length": n})
    return out


EVAL = samples(EVAL_LENGTHS, seed=1)
TRAIN = samples((20, 12, 18, 10, 25, 5), seed=0)


def tiny_model():
    """tiny-qwen3 with its final norm scaled by 20: logits ~20 times larger, so per-token losses spread widely
    (from near 0 to tens) and batches of other tokens have clearly other means (at init every token costs
    about log(512))."""
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference", dtype=torch.float32, seed=0)
    with torch.no_grad():
        model.model.norm.weight.mul_(20.0)
    return model


def unpacked_eval_loss(model, rows, reduction):
    """Every sample alone on the model's own sdpa attention: the token mean over all supervised tokens, or
    the mean over samples of each sample's token mean."""
    current = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    model.eval()
    sums, counts = [], []
    try:
        with torch.no_grad():
            for s in rows:
                labels = torch.tensor([s["labels"]])
                logits = model(input_ids=torch.tensor([s["input_ids"]])).logits
                sums.append(float(causal_lm_loss(logits, labels, num_items_in_batch=1)))
                counts.append(int((labels[0, 1:] != -100).sum()))
    finally:
        model.set_attn_implementation(current)
    if reduction == "token":
        return sum(sums) / sum(counts)
    return sum(t / c for t, c in zip(sums, counts)) / len(rows)


def per_batch_mean(trainer, dataset=None):
    """Trainer's own eval reduction on the same batches: the mean of per-batch mean losses."""
    loader = trainer.get_eval_dataloader(dataset)
    out = transformers.Trainer.evaluation_loop(trainer, loader, "Evaluation", prediction_loss_only=True)
    return out.metrics["eval_loss"]


class _Tok:
    pad_token_id = 0

    def save_pretrained(self, path):
        return None


def _varpack_trainer(tmp_path, reduction, batch_size):
    from varpack.train import SFTConfig, build_sft

    config = SFTConfig(
        model="tiny-qwen3",
        output_dir=str(tmp_path / "out"),
        packing_length=32,
        attn_backend="reference",
        loss_reduction=reduction,
        save=False,
        max_steps=1,
        report_to="none",
        extra_training_args={"use_cpu": True, "per_device_eval_batch_size": batch_size, "disable_tqdm": True},
    )
    return build_sft(config, model=tiny_model(), tokenizer=_Tok(), encoded=TRAIN).trainer


def _check(got, old, want, layouts):
    """Every layout's eval loss equals the unpacked value; Trainer's per-batch means (the control) do not."""
    for layout in layouts:
        assert_exact(got[layout], want, rtol=LOSS_RTOL, what=f"eval loss {layout}")
    # the control: off by far more than the tolerance in every layout (the per-batch means spread by 1e-3)
    off = [measure(old[layout], want, rtol=LOSS_RTOL, what=f"per-batch mean {layout}") for layout in layouts]
    assert all(g.ratio > 10 for g in off), [str(g) for g in off]
    assert len({round(v, 6) for v in old.values()}) == len(layouts)  # ... and it moves with the layout


@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_packed_sft_trainer_eval_loss_is_independent_of_packing(tmp_path, reduction):
    from varpack.data.dataset import PackedDataset
    from varpack.train.sft import plan_samples

    got, old = {}, {}
    for packing_length, batch_size in LAYOUTS:
        trainer = _varpack_trainer(tmp_path / f"{packing_length}", reduction, batch_size)
        _, plan = plan_samples(EVAL, packing_length=packing_length)
        dataset = PackedDataset(EVAL, plan, shuffle=False)
        got[packing_length] = trainer.evaluate(eval_dataset=dataset)["eval_loss"]
        old[packing_length] = per_batch_mean(trainer, dataset)
    want = unpacked_eval_loss(trainer.model, EVAL, reduction)
    _check(got, old, want, list(got))


@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_trl_trainer_eval_loss_is_independent_of_packing(tmp_path, reduction):
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from trl import SFTConfig

    from varpack.models import load_tokenizer_for
    from varpack.train.trl import VarpackSFTTrainer

    tokenizer = load_tokenizer_for("tiny-qwen3")
    rows = [{"input_ids": s["input_ids"], "labels": s["labels"]} for s in EVAL]
    train = [{"input_ids": s["input_ids"], "labels": s["labels"]} for s in TRAIN]
    got, old = {}, {}
    for packing_length, batch_size in LAYOUTS:
        args = SFTConfig(
            output_dir=str(tmp_path / f"trl{packing_length}"),
            max_length=packing_length,
            per_device_eval_batch_size=batch_size,
            report_to=[],
            use_cpu=True,
            bf16=False,  # TRL's default: bfloat16 autocast
            disable_tqdm=True,
            train_sampling_strategy="sequential",
        )
        trainer = VarpackSFTTrainer(
            model=tiny_model(),
            args=args,
            train_dataset=datasets.Dataset.from_list(train),
            eval_dataset=datasets.Dataset.from_list(rows),
            processing_class=tokenizer,
            attn_backend="reference",
            loss_reduction=reduction,
        )
        got[packing_length] = trainer.evaluate()["eval_loss"]
        old[packing_length] = per_batch_mean(trainer)
    want = unpacked_eval_loss(trainer.model, EVAL, reduction)
    _check(got, old, want, list(got))


_SCRIPT = r"""
import json, os, pathlib, sys
sys.path.insert(0, {root!r})
import transformers
from tests.train.test_eval_loss import EVAL, _varpack_trainer
from varpack.data.dataset import PackedDataset
from varpack.train.sft import plan_samples
out = pathlib.Path({out!r})
result = {{}}
for reduction in ("token", "sample"):
    trainer = _varpack_trainer(out / reduction, reduction, 2)
    _, plan = plan_samples(EVAL, packing_length=48)
    dataset = PackedDataset(EVAL, plan, shuffle=False)
    result["packs"] = len(dataset)
    result[reduction] = trainer.evaluate(eval_dataset=dataset)["eval_loss"]
    # control: accelerate's own sharding under the same loop (it repeats packs to even the ranks out)
    loader = transformers.Trainer.get_eval_dataloader(trainer, dataset)
    output = trainer.evaluation_loop(loader, "Evaluation", prediction_loss_only=True)
    result[reduction + "-control"] = output.metrics["eval_loss"]
(out / f"result{{os.environ['RANK']}}.json").write_text(json.dumps(result))
del trainer, loader  # no DDP-wrapped model may outlive the group (close_process_group)
from varpack.train.distributed import close_process_group
close_process_group()
"""


def test_eval_loss_on_two_gloo_ranks_counts_every_pack_once(tmp_path):
    """torchrun, 2 CPU ranks over gloo, 11 eval packs in batches of 2 per rank: each rank reports the
    one-process unpacked value (the packs dealt by BalancedPackSampler, each to one rank once); under
    accelerate's own sharding (the control), which repeats a pack to fill the last batch, the same sums count
    that pack twice."""
    results = launch.run_ranks(_SCRIPT, tmp_path)
    assert results[0]["packs"] % 4 != 0  # 2 ranks x 2 packs: the last batch needs a filler
    model = tiny_model()
    for reduction in ("token", "sample"):
        want = unpacked_eval_loss(model, EVAL, reduction)
        for r in range(2):
            what = f"rank {r} eval loss ({reduction})"
            assert_exact(results[r][reduction], want, rtol=LOSS_RTOL, what=what)
            control = measure(results[r][reduction + "-control"], want, rtol=LOSS_RTOL, what=f"{what}, control")
            assert control.ratio > 10, str(control)
