"""examples/trl_sft.py (the README's "Keep your TRL script") runs: TRL prepares the built-in chats with
assistant-only labels, varpack packs and trains them for two steps."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

pytest.importorskip("trl")  # the `trl` extra; `make test` installs it

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl_sft.py"


def test_trl_example_runs(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("trl_sft_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--max-steps", "2", "--max-samples", "12", "--packing-length", "512", "--overflow", "split"]
    trainer = module.main([*argv, "--output-dir", str(tmp_path / "out")])
    assert trainer.state.global_step == 2
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(math.isfinite(x) for x in losses)
    labels = [x for s in trainer.samples for x in s["labels"]]
    # assistant-only loss: TRL's assistant masks reached the labels (prompts masked, answers supervised)
    assert 0 < sum(x != -100 for x in labels) < len(labels)
    assert max(len(p) for p in trainer.plan.packs) >= 1 and trainer.plan.num_samples >= 12
    assert "samples in" in capsys.readouterr().out
