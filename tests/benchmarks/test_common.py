"""benchmarks/_common.py, the harness every benchmark shares: the round order, the merge of rounds with each
round's strongest peer, the untimed cold pass before the timed ones, the budget, tables, lengths and
workloads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks import _common as C


def test_round_order_rotates_and_reverses():
    assert [C.round_order(3, r) for r in range(4)] == [[0, 1, 2], [2, 1, 0], [1, 2, 0], [0, 2, 1]]
    assert C.round_order(1, 5) == [0]


def test_merge_rounds_ratio_to_each_rounds_strongest_peer():
    rounds = [
        [
            {"config": "peer_a", "tps": 100.0},
            {"config": "peer_b", "tps": 80.0},
            {"config": "ours", "tps": 150.0},
        ],
        [
            {"config": "ours", "tps": 90.0},
            {"config": "peer_b", "tps": 120.0},
            {"config": "peer_a", "error": "OOM"},
        ],
    ]
    rows = {r["config"]: r for r in C.merge_rounds(rounds, "tps", ("peer_a", "peer_b"), baseline="peer_b")}
    ours = rows["ours"]
    assert ours["vs_best_peer_rounds"] == pytest.approx([1.5, 0.75]) and ours["best_peer_rounds"] == [
        "peer_a",
        "peer_b",
    ]
    assert (
        ours["tps"] == pytest.approx(120.0) and ours["order_dependent"] is True
    )  # 1.5 and 0.75: both sides of 1
    assert ours["vs_peer_b"] == pytest.approx(np.mean([150 / 80, 90 / 120]))
    assert rows["peer_a"]["vs_best_peer_rounds"] == [1.0] and "error" not in rows["peer_a"]
    assert C.missing_rounds(rows["peer_a"]) == ["round 2 not measured (OOM)"]
    failed = C.merge_rounds([[{"config": "x", "error": "boom"}]], "tps", ("x",))[0]
    assert failed["error"] == "boom" and "vs_best_peer" not in failed


def test_cold_pass_is_untimed_and_reported_apart():
    calls = []

    def step(i):
        calls.append(i)
        return torch.tensor(float(i + 1))

    t = C.cold_then_timed(step, 3, "cpu", passes=2, per_step=True)
    assert calls == [0, 1, 2] * 3  # the cold pass, then two timed passes over the same steps
    assert len(t["timed_pass_s"]) == 2 and t["seconds"] == pytest.approx(np.median(t["timed_pass_s"]))
    assert t["loss_first"] == 1.0 and len(t["step_s"]) == 3 and t["cold_pass_s"] >= t["cold_first_step_s"]
    calls.clear()
    t = C.cold_then_timed(step, 2, "cpu", passes=5, seconds=0.0)  # a spent share: one timed pass still runs
    assert len(t["timed_pass_s"]) == 1 and calls == [0, 1, 0, 1]


def test_run_rounds_records_failures_and_the_budget():
    def run_one(name):
        if name == "bad":
            raise RuntimeError("cannot run here\nsecond line")
        return {"v": 1.0}

    rounds = C.run_rounds(["a", "bad", "c"], run_one, 2)
    assert [r["config"] for r in rounds[1]] == ["c", "bad", "a"]
    assert rounds[0][1]["error"] == "RuntimeError: cannot run here"
    spent = C.run_rounds(["a"], run_one, 1, budget=C.Budget(0.0))
    assert spent[0][0]["error"].startswith("skipped: --time-budget 0 s")


def test_budget_and_table():
    now = [0.0]
    b = C.Budget(2.0, clock=lambda: now[0])
    assert not b.spent() and b.left() == 2.0
    now[0] = 2.0
    assert b.spent() and not C.Budget(None).spent()
    assert C.markdown_table(["a", "b"], [[1234.5, float("nan")], [0.01234, None]]).splitlines() == [
        "| a | b |", "|---|---|", "| 1,234 | - |", "| 0.0123 | - |"]  # fmt: skip


def test_lengths_files_fits_and_workloads(tmp_path):
    per_file, source = C.lengths_for(True, n_small=500)
    assert (
        len(per_file) == 2
        and "stand-in" in source
        and all(v.size == 500 and v.min() >= 8 for v in per_file.values())
    )
    path = tmp_path / "lengths.txt"
    path.write_text("3 5\n7\n")
    assert C.read_lengths_file(path).tolist() == [3, 5, 7]
    path.write_text("3 0\n")
    with pytest.raises(ValueError, match="all >= 1"):
        C.read_lengths_file(path)
    mu, sigma = C.fit_lognormal(np.exp([1.0, 3.0]))
    assert mu == pytest.approx(2.0) and sigma == pytest.approx(1.0)
    samples = C.synthetic_samples(200, vocab=50, hi=256, seed=1)
    ds, chosen, info = C.fullest_packs(samples, 256, 3)
    assert len(chosen) == 3 and info["steps"] == 3 and info["fill_mean"] > 0.9
    assert all(sum(s["length"] for s in ds[i]) <= 256 for i in chosen)
    with pytest.raises(ValueError, match="not enough for 300 packs"):
        C.fullest_packs(samples, 256, 300)


def test_machine_facts_and_encoded_samples_round_trip(tmp_path):
    info = C.machine_info("cpu")
    assert {"date", "command", "commit", "torch", "cpu"} <= set(info)
    out = tmp_path / "s.jsonl"
    out.write_text(json.dumps({"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}) + "\n")
    (sample,) = C.load_samples(out)
    assert sample["length"] == 3 and sample["labels"].tolist() == [-100, 2, 3]


def _adamw_run(impl, lr=1e-2, steps=3):
    """The parameters' displacement after ``steps`` AdamW steps of one small model from one initialisation."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    start = [p.detach().clone() for p in model.parameters()]
    opt = C.make_optimizer(model, "cpu", lr=lr, impl=impl)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach() - p0 for p, p0 in zip(model.parameters(), start)]


def test_compiled_optimizer_step_is_adamw():
    """``--optimizer compiled`` runs the same AdamW update as the eager step: three steps in float32, each
    parameter's displacement within 1e-4 of its scale (float32 evaluation order of the update; measured
    ~6e-6); a learning rate 1% off is 100x outside it (control)."""
    eager, compiled, off = _adamw_run("fused"), _adamw_run("compiled"), _adamw_run("fused", lr=1.01e-2)
    for e, c, o in zip(eager, compiled, off):
        scale = e.abs().max()
        assert (c - e).abs().max() <= 1e-4 * scale
        assert (o - e).abs().max() > 5e-3 * scale
    with pytest.raises(ValueError, match="'adam8bit'.*fused"):
        C.make_optimizer(torch.nn.Linear(2, 2), "cpu", impl="adam8bit")


def test_every_compiled_optimizer_compiles():
    """A benchmark process builds one optimizer per row; every ``Optimizer.step`` is one code object, so from
    the ninth on dynamo's recompile limit ran the step uncompiled under the label "compiled". Each one now
    compiles (a new dynamo frame per optimizer)."""
    from torch._dynamo.utils import counters

    limit = torch._dynamo.config.recompile_limit
    for _ in range(limit + 1):
        model = torch.nn.Linear(4, 2)
        opt = C.make_optimizer(model, "cpu", impl="compiled")
        before = counters["frames"]["ok"]
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        assert counters["frames"]["ok"] > before
