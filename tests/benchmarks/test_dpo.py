"""benchmarks/dpo.py --small: packed and padded DPO steps on the same pairs from the same weights; at init
(policy == reference) both losses are log 2, so the two layouts compute the same loss."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.dpo import main


def test_small_run_same_first_loss(tmp_path):
    out = tmp_path / "dpo.json"
    assert main(["--small", "--out", str(out)]) == 0
    configs = json.loads(out.read_text())["configs"]
    assert set(configs) == {"padded", "varpack"}
    for c in configs.values():
        assert c["loss_first"] == pytest.approx(math.log(2), abs=1e-4) and c["tokens_per_s"] > 0
    assert configs["varpack"]["tokens_processed_per_pass"] < configs["padded"]["tokens_processed_per_pass"]
    assert configs["padded"]["ratio_to_padded"] == 1.0
