"""Logging of a packed run: varpack's per-step metrics through ``Trainer.log`` into TensorBoard's
event files, the packing report as ``packing_report.json`` / TensorBoard text / a W&B artifact, the attention
backend chosen. Expected values are recounted from the plan and the encoded samples, not from the trainer."""

from __future__ import annotations

import json
import math
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from tests.train.test_cli_sft import VOCAB, _Tok, synthetic_samples
from varpack.models import load_model
from varpack.plan.report import plan_summary
from varpack.train import SFTConfig, run_sft
from varpack.train.reporting import PACKING_REPORT_FILE, RunReportCallback

L = 32


def _run(tmp_path, **cfg):
    kw = dict(
        model="tiny-qwen3",
        output_dir=str(tmp_path / "out"),
        packing_length=L,
        attn_backend="reference",
        save=False,
        logging_steps=1,
        packs_per_step=2,
        grad_accum=2,
        extra_training_args={"optim": "sgd", "max_grad_norm": 0.0, "use_cpu": True},
    )
    kw.update(cfg)
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    encoded = synthetic_samples(n=24)
    run = run_sft(SFTConfig(**kw), print_fn=lambda *_: None, model=model, tokenizer=_Tok(), encoded=encoded)
    return run, encoded


def _expected_steps(run, encoded, epochs=1):
    """Per optimizer step: (packs, samples, tokens, supervised tokens), recounted from the plan's per-epoch
    pack order and the samples' labels (micro-batch = packs_per_step packs, step = grad_accum micro-batches;
    an epoch's last step takes the micro-batches left)."""
    plan, cfg = run.plan, run.config
    per_step = cfg.packs_per_step * cfg.grad_accum
    steps = []
    for epoch in range(epochs):
        order = plan.pack_order(epoch)
        for s in range(0, len(order), per_step):
            packs = [plan.pack(int(p)) for p in order[s : s + per_step]]
            ids = [int(i) for pack in packs for i in pack]
            tokens = sum(len(encoded[i]["input_ids"]) for i in ids)
            supervised = sum(int((np.asarray(encoded[i]["labels"]) != -100).sum()) for i in ids)
            steps.append((len(packs), len(ids), tokens, supervised))
    return steps


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list(logdir.rglob("events.out.tfevents.*"))
    assert len(files) == 1, files
    acc = EventAccumulator(str(files[0].parent), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    out = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    texts = {}
    for tag in acc.Tags()["tensors"]:
        from tensorboard.util import tensor_util

        texts[tag] = [tensor_util.make_ndarray(e.tensor_proto).item().decode() for e in acc.Tensors(tag)]
    return out, texts


def test_tensorboard_gets_varpack_metrics_and_report(tmp_path):
    pytest.importorskip("tensorboard")
    run, encoded = _run(tmp_path, report_to="tensorboard")
    expected = _expected_steps(run, encoded)
    assert len(expected) >= 3 and run.trainer.state.global_step == len(expected)

    scalars, texts = _scalars(tmp_path / "out")
    for key, col in (("packs", 0), ("samples", 1), ("tokens", 2), ("supervised_tokens", 3)):
        got = scalars[f"train/{key}_per_step"]
        assert [s for s, _ in got] == list(range(1, len(expected) + 1))
        assert [v for _, v in got] == [float(e[col]) for e in expected], key
    fills = [v for _, v in scalars["train/pack_fill"]]
    assert fills == pytest.approx([t / (p * L) for p, _, t, _ in expected], rel=1e-6)
    # the whole epoch: the fill of the logged steps is the plan's (and the report's) fill
    report = json.loads((tmp_path / "out" / PACKING_REPORT_FILE).read_text())
    assert sum(e[2] for e in expected) / (sum(e[0] for e in expected) * L) == pytest.approx(
        report["fill_ratio"], rel=1e-12
    )
    assert all(v > 0 for _, v in scalars["train/tokens_per_second"])
    assert "train/loss" in scalars

    # the report file is the plan's report (plan_summary of the same lengths), plus the backend
    lengths = [s["length"] for s in encoded]
    plan_report = plan_summary(run.plan, lengths, data="given samples")  # encoded= passed in
    assert {k: report[k] for k in plan_report} == json.loads(json.dumps(plan_report))
    assert report["attn_backend"]["name"] == "reference" and report["overflow"]["unsupervised_pieces"] == []
    # ... and the same text that was printed, as a TensorBoard text summary
    text = texts["varpack/packing_report/text_summary"][0]
    assert [line.strip() for line in text.splitlines()] == [line.strip() for line in run.report.splitlines()]
    assert texts["varpack/attn_backend/text_summary"][0].startswith("**reference**")


def test_report_to_none_writes_no_event_files(tmp_path):
    """Control of the test above: the metrics are still in the run's history, no event file, no report file
    without saving, and nothing left in the unsaved output dir."""
    run, encoded = _run(tmp_path, report_to="none", max_steps=2)
    assert not list(tmp_path.rglob("events.out.tfevents.*"))
    assert not (tmp_path / "out").exists()
    expected = _expected_steps(run, encoded)[:2]
    got = [
        (h["packs_per_step"], h["samples_per_step"], h["tokens_per_step"], h["supervised_tokens_per_step"])
        for h in run.history
    ]
    assert got == [tuple(float(x) for x in e) for e in expected]


def test_logging_window_averages_over_steps(tmp_path):
    """logging_steps=2: an entry at steps 1 (logging_first_step), 2, 4, each count the mean of the steps since
    the previous entry; steps 3 and 4 straddle the epoch boundary (step 4: the epoch-1 pack order)."""
    run, encoded = _run(tmp_path, report_to="none", logging_steps=2, max_steps=4)
    expected = _expected_steps(run, encoded, epochs=2)
    assert len(expected) > 4 and len(_expected_steps(run, encoded)) == 3  # step 4 is in epoch 1
    by_step = {h["step"]: h for h in run.history}
    assert sorted(by_step) == [1, 2, 4]
    for key, col in (("packs", 0), ("samples", 1), ("tokens", 2), ("supervised_tokens", 3)):
        assert by_step[1][f"{key}_per_step"] == expected[0][col]
        assert by_step[2][f"{key}_per_step"] == expected[1][col]
        assert by_step[4][f"{key}_per_step"] == (expected[2][col] + expected[3][col]) / 2
    assert by_step[4]["pack_fill"] == pytest.approx(
        (expected[2][2] + expected[3][2]) / ((expected[2][0] + expected[3][0]) * L)
    )


def test_batch_stats_exclude_padding():
    from varpack.collate import PaddingFreeCollator
    from varpack.train.trainer import TrainCollator

    samples = synthetic_samples(n=5)
    collate = TrainCollator(PaddingFreeCollator(pad_token_id=0, pad_to_multiple_of=16))
    batch = collate([samples[:2], samples[2:5]])
    tokens = sum(s["length"] for s in samples[:5])
    assert batch["input_ids"].shape[1] > tokens  # padded: the control that padding is not counted
    supervised = sum(int((np.asarray(s["labels"]) != -100).sum()) for s in samples[:5])
    assert batch["batch_stats"] == {
        "packs": 2,
        "samples": 5,
        "tokens": tokens,
        "supervised_tokens": supervised,
    }


class _FakeWandbRun:
    id = "abc123"

    def __init__(self):
        self.config = types.SimpleNamespace(
            values={}, update=lambda d, allow_val_change: self.config.values.update(d)
        )
        self.artifacts = []

    def log_artifact(self, artifact):
        self.artifacts.append(artifact)


class _FakeArtifact:
    def __init__(self, name, type):
        self.name, self.type, self.files = name, type, []

    def add_file(self, path, name=None):
        self.files.append((path, name))


def test_wandb_gets_config_and_report_artifact(tmp_path, monkeypatch):
    """wandb is not installed here: a stand-in module records what the callback hands to W&B."""
    from transformers.integrations import WandbCallback

    from varpack.train import build_sft

    fake = types.ModuleType("wandb")
    fake.run = _FakeWandbRun()
    fake.Artifact = _FakeArtifact
    monkeypatch.setitem(sys.modules, "wandb", fake)
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    cfg = SFTConfig(
        model="tiny-qwen3",
        output_dir=str(tmp_path / "out"),
        packing_length=L,
        attn_backend="reference",
        save=True,
        extra_training_args={"use_cpu": True},
    )
    run = build_sft(cfg, model=model, tokenizer=_Tok(), encoded=synthetic_samples())
    run.trainer.callback_handler.callbacks.insert(0, WandbCallback.__new__(WandbCallback))
    cb = next(c for c in run.trainer.callback_handler.callbacks if isinstance(c, RunReportCallback))
    state = types.SimpleNamespace(is_world_process_zero=True, global_step=0)
    cb.on_train_begin(run.trainer.args, state, None, model=run.model)
    values = fake.run.config.values
    assert values["varpack/attn_backend"] == "reference"
    assert (
        values["varpack/fill_ratio"] == run.plan.fill_ratio
        and values["varpack/num_packs"] == run.plan.num_packs
    )
    (artifact,) = fake.run.artifacts
    assert artifact.type == "packing-report" and artifact.files == [(cb.report_path, PACKING_REPORT_FILE)]
    assert json.loads(Path(cb.report_path).read_text())["num_packs"] == run.plan.num_packs


def test_auto_backend_is_resolved(tmp_path):
    """auto names the backend it picks on this machine (CPU: sdpa first) with the reason."""
    from varpack.train.reporting import resolved_attn_backend

    run, _ = _run(tmp_path, report_to="none", max_steps=1)
    import torch

    got = resolved_attn_backend(run.model, "auto", run.plan, dtype=torch.float32, device=torch.device("cpu"))
    assert got["name"] == "sdpa" and "auto on cpu" in got["reason"]
    assert math.isfinite(run.history[0]["loss"])


@pytest.mark.parametrize(
    ("report_to", "message"),
    [
        ("tensorboard,none", "'none' stands alone"),
        ("all,tensorboard", "'all' stands alone"),
        ("tensorbord", "no transformers integration 'tensorbord'"),
        (",", "names no integration"),
    ],
)
def test_bad_report_to_is_refused_before_the_data(report_to, message):
    """A bad --report-to was refused by transformers only once the Trainer was built (after the data was
    encoded), without the setting's name ("none is not supported, ..."); now build_sft refuses it first.
    ``encoded`` is a bad value: reaching the data would raise another error."""
    from varpack.train import build_sft

    with pytest.raises(ValueError, match=rf"report_to='{re.escape(report_to)}'.*{re.escape(message)}"):
        build_sft(SFTConfig(report_to=report_to), tokenizer=_Tok(), encoded=object())


def test_report_to_a_missing_package_is_refused(monkeypatch):
    """``--report-to wandb`` without wandb: transformers' RuntimeError traceback at Trainer build; now a
    ValueError naming report_to (the CLI prints it as --report-to)."""
    import transformers.integrations.integration_utils as iu

    from varpack.train.sft import _report_to

    monkeypatch.setattr(iu, "get_available_reporting_integrations", lambda: ["tensorboard"])
    with pytest.raises(ValueError, match=r"report_to='tensorboard,wandb'.*'wandb'.*not installed"):
        _report_to("tensorboard,wandb")
    assert _report_to(" tensorboard , ") == ["tensorboard"] and _report_to("none") == "none"


def test_report_names_the_backend_the_run_chose_and_why(tmp_path):
    """A backend the run put in place of the config's (the captured layers' triton_short) is reported with the
    run's reason, not as forced by the caller; without a reason it is what the registry says (control)."""
    import types

    run, _ = _run(tmp_path, report_to="none", max_steps=1)
    state = types.SimpleNamespace(is_world_process_zero=True, global_step=0)
    reports = []
    for reason in ("auto's choice cannot be captured", None):
        cb = RunReportCallback(
            run.trainer, summary={}, text="", plan=run.plan, backend="sdpa", write_file=False, reason=reason
        )
        cb.on_train_begin(run.trainer.args, state, None, model=run.model)
        reports.append(cb.report["attn_backend"])
    assert reports[0] == {"name": "sdpa", "reason": "auto's choice cannot be captured"}
    assert reports[1]["name"] == "sdpa" and reports[1]["reason"] == "sdpa: forced by the caller"
