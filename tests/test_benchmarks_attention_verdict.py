"""benchmarks/attention.py's triton_short verdict (issue 17): same-run ratios, the goal per mix, and an
AUTO_TRITON_SHORT row proposed only where triton_short beats auto's pick and the best peer by the margin."""

from __future__ import annotations

from benchmarks.attention import PROPOSE_MARGIN, triton_short_verdict, verdict_lines


def _rows(mix, speeds, auto_note="-> torch_varlen", errs=None):
    rows = []
    for impl, tf in speeds.items():
        row = {
            "mix": mix,
            "H": 16,
            "Hkv": 4,
            "D": 128,
            "impl": impl,
            "note": auto_note if impl == "auto" else "",
        }
        if tf is None:
            row["error"] = "RuntimeError: boom"
        else:
            row["fwd_bwd_tflops"] = tf
            err = (errs or {}).get(impl, 2e-3)
            if err is not None:
                row["max_abs_diff"] = err
        rows.append(row)
    return rows


MIXES = {"short": {"mean": 74.2, "max": 128}, "lognormal": {"mean": 207.0, "max": 1633}}


def test_short_mix_goal_met_and_row_proposed():
    rows = _rows(
        "short",
        {"flash_attn_4": 24.1, "torch_varlen": 27.8, "flex": 15.8, "triton_short": 60.0, "auto": 27.8},
    )
    (v,) = triton_short_verdict(rows, MIXES)
    assert v["best_peer"] == "torch_varlen" and abs(v["vs_best_peer"] - 60.0 / 27.8) < 1e-9
    assert abs(v["vs_flash_attn_4"] - 60.0 / 24.1) < 1e-9 and v["goal_met"] is True
    assert (
        v["propose"] == "TritonShortRule(max_seqlen=128, max_mean_seqlen=74, training=True, head_dims=(128,))"
    )
    (line,) = verdict_lines([v])
    assert "MET" in line and "propose AUTO_TRITON_SHORT row" in line


def test_goal_needs_both_the_ratio_and_the_floor():
    rows = _rows("short", {"torch_varlen": 20.0, "triton_short": 50.0, "auto": 20.0})  # 2.5x, but < 56
    (v,) = triton_short_verdict(rows, MIXES)
    assert v["vs_best_peer"] >= 2 and v["goal_met"] is False
    assert "propose" in v  # a same-run win still proposes a row; the goal is a separate question


def test_small_lead_or_a_loss_proposes_nothing():
    near = _rows(
        "lognormal", {"flash_attn_4": 135.0, "triton_short": 135.0 * (PROPOSE_MARGIN - 0.01), "auto": 135.0}
    )
    (v,) = triton_short_verdict(near, MIXES)
    assert "propose" not in v and v["goal_met"] is False and v["vs_flash_attn_4"] < 1.05
    beats_peer_not_auto = _rows(
        "lognormal",
        {"torch_varlen": 100.0, "triton_short": 140.0, "auto": 139.0},
        auto_note="-> flash_attn_4",
    )
    (w,) = triton_short_verdict(beats_peer_not_auto, MIXES)
    assert "propose" not in w  # auto's pick (FA4 here) is as fast: no row
    assert "no AUTO_TRITON_SHORT row" in verdict_lines([w])[0]


def test_no_verdict_without_a_triton_short_measurement():
    assert triton_short_verdict(_rows("short", {"torch_varlen": 28.0, "auto": 28.0}), MIXES) == []
    assert triton_short_verdict(_rows("short", {"torch_varlen": 28.0, "triton_short": None}), MIXES) == []


def test_a_wrong_or_unchecked_output_meets_no_goal_and_proposes_nothing():
    speeds = {"flash_attn_4": 24.1, "torch_varlen": 27.8, "triton_short": 60.0, "auto": 27.8}
    (ok,) = triton_short_verdict(_rows("short", speeds, errs={"flash_attn_4": 4e-3}), MIXES)
    assert ok["exact"] is True and ok["goal_met"] is True and "propose" in ok  # 2e-3 <= 2 * 4e-3
    (bad,) = triton_short_verdict(_rows("short", speeds, errs={"triton_short": 0.5}), MIXES)
    assert bad["exact"] is False and bad["goal_met"] is False and "propose" not in bad
    (line,) = verdict_lines([bad])
    assert "output WRONG" in line and "not met" in line and "no AUTO_TRITON_SHORT row" in line
    (unchecked,) = triton_short_verdict(_rows("short", speeds, errs={"triton_short": None}), MIXES)
    assert unchecked["exact"] is None and unchecked["goal_met"] is False and "propose" not in unchecked
    assert "NOT checked" in verdict_lines([unchecked])[0]


def test_synced_verdict_reads_the_synced_speeds():
    """queued and synced timings of one run give separate verdicts: met on one, not on the other."""
    rows = _rows("short", {"torch_varlen": 28.0, "triton_short": 60.0, "auto": 28.0})
    synced = {"torch_varlen": 27.0, "triton_short": 50.0, "auto": 27.0}
    for row in rows:
        row["fwd_bwd_tflops_synced"] = synced[row["impl"]]
    (queued,) = triton_short_verdict(rows, MIXES)
    (slow,) = triton_short_verdict(rows, MIXES, timing="synced")
    assert queued["goal_met"] and queued["timing"] == "queued"
    assert not slow["goal_met"] and slow["triton_short"] == 50.0 and slow["timing"] == "synced"
    assert "(synced)" in verdict_lines([slow])[0]


def test_unknown_timing_refused():
    import pytest

    with pytest.raises(ValueError, match="timing"):
        triton_short_verdict([], MIXES, timing="wall")
