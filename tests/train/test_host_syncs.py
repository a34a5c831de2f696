"""No host sync per step from the training loop around varpack's step: Trainer's ``logging_nan_inf_filter``
runs on the device (the logged losses equal Trainer's own host-side filter; negative control: without a filter
the NaN is logged), and a CUDA run's pinned batches are copied without blocking (``non_blocking_copies``).
The TRL drop-in's side: tests/train/test_trl_step.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import transformers

from tests.train.test_cli_sft import VOCAB, _Tok, synthetic_samples
from varpack.models import load_model
from varpack.train import SFTConfig, run_sft
from varpack.train import trainer as trainer_module
from varpack.train.trainer import FILTER_ON_DEVICE, nan_inf_filtered_loss, non_blocking_copies


def test_nan_inf_filtered_loss():
    window = torch.tensor(6.0)
    assert nan_inf_filtered_loss(torch.tensor(2.5), window, 3).item() == 2.5
    for bad in (float("nan"), float("inf"), float("-inf")):
        assert nan_inf_filtered_loss(torch.tensor(bad), window, 3).item() == 2.0
    assert nan_inf_filtered_loss(torch.tensor(float("nan")), torch.tensor(0.0), 1).item() == 0.0


def test_this_transformers_keeps_the_window_where_the_filter_reads_it():
    assert FILTER_ON_DEVICE, (
        f"transformers {transformers.__version__}: Trainer's loss window is not Trainer._tr_loss; the NaN filter "
        "falls back to Trainer's own host read (a sync per step)"
    )


NAN_CALL = 3  # the second micro-batch of step 2


def _run(tmp_path, monkeypatch, *, nan_filter: bool):
    """varpack sft's trainer, 3 steps of 2 micro-batches, one micro-batch's logged loss made NaN (its gradients
    untouched: only the value Trainer logs)."""
    calls = {"n": 0}
    base_step = transformers.Trainer.training_step

    def training_step(self, *a, **k):
        out = base_step(self, *a, **k)
        calls["n"] += 1
        return torch.full_like(out, float("nan")) if calls["n"] == NAN_CALL else out

    monkeypatch.setattr(transformers.Trainer, "training_step", training_step)
    cfg = SFTConfig(
        model="tiny-qwen3",
        output_dir=str(tmp_path / "out"),
        packing_length=32,
        attn_backend="reference",
        save=False,
        logging_steps=1,
        packs_per_step=1,
        grad_accum=2,
        max_steps=3,
        extra_training_args={
            "optim": "sgd", "max_grad_norm": 0.0, "use_cpu": True, "logging_nan_inf_filter": nan_filter,
        },  # fmt: skip
    )
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference", seed=0)
    run = run_sft(cfg, print_fn=lambda *_: None, model=model, tokenizer=_Tok(), encoded=synthetic_samples(n=24))
    return run, [h["loss"] for h in run.history]


def test_the_filter_on_the_device_logs_what_trainers_own_filter_logs(tmp_path, monkeypatch):
    run, on_device = _run(tmp_path / "a", monkeypatch, nan_filter=True)
    assert run.trainer.nan_inf_filter_on_device and not run.trainer.args.logging_nan_inf_filter
    with monkeypatch.context() as m:
        m.setattr(trainer_module, "FILTER_ON_DEVICE", False)  # Trainer's own check (a host read per step)
        run_host, on_host = _run(tmp_path / "b", monkeypatch, nan_filter=True)
    assert not run_host.trainer.nan_inf_filter_on_device and run_host.trainer.args.logging_nan_inf_filter
    assert len(on_device) == len(on_host) == 3
    assert all(math.isfinite(x) for x in on_device)
    assert on_device == pytest.approx(on_host, rel=1e-6)
    # negative control: no filter, the NaN micro-batch makes step 2's logged loss NaN
    _, unfiltered = _run(tmp_path / "c", monkeypatch, nan_filter=False)
    assert math.isnan(unfiltered[1]) and unfiltered[0] == pytest.approx(on_device[0], rel=1e-6)


def _args(**kw):
    return transformers.TrainingArguments(output_dir="unused", report_to="none", **kw)


def test_non_blocking_copies_on_a_pinned_cuda_run(monkeypatch):
    args, unpinned = _args(dataloader_pin_memory=True), _args(dataloader_pin_memory=False)
    assert non_blocking_copies(args) is args.accelerator_config  # this machine: no CUDA, nothing changes
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = non_blocking_copies(args)
    assert cfg.non_blocking and not args.accelerator_config.non_blocking  # a copy: the given config untouched
    assert dataclasses.replace(cfg, non_blocking=False) == args.accelerator_config
    assert not non_blocking_copies(unpinned).non_blocking
