"""benchmarks/train.py: the static / custom-op / CUDA-graph configs (option parsing, the boundaries' place,
real-token counting of static packs: pad tokens never count as throughput, the CPU refusal of CUDA graphs), a
backend per row, the --time-budget (configurations not started in time skipped with a row that says so, --out
holding every finished row after each configuration) and the targets line; --small runs on the CPU."""

from __future__ import annotations

import json

import pytest

from benchmarks import train as T
from benchmarks._common import merge_rounds
from varpack.collate import PaddingFreeCollator, StaticShape


def test_config_options():
    assert T.split_config("varpack_lce_compile") == ("varpack_lce", {"compile"})
    assert T.split_config("varpack_lce_compile_ops") == ("varpack_lce", {"compile", "ops"})
    assert T.split_config("varpack_lce_static_compile_ops") == ("varpack_lce", {"compile", "ops", "static"})
    assert T.split_config("varpack_lce_static_graphs") == (
        "varpack_lce",
        {"compile", "ops", "static", "graphs"},
    )
    assert T.split_config("varpack_lce_chunked") == ("varpack_lce_chunked", set())
    assert T.keep_cpu_keys("varpack_lce_compile") == T.VARPACK_CPU_KEYS
    assert T.keep_cpu_keys("varpack_lce_static_graphs") == () == T.keep_cpu_keys("hf_fa4")
    for name in ("varpack_lce_compile_ops", "varpack_lce_static_compile_ops", "varpack_lce_static_graphs"):
        assert name in T.ALL_CONFIGS


def test_static_pack_counts_real_tokens_and_moves_its_meta():
    samples = [
        {"input_ids": [5] * n, "labels": [-100] + [5] * (n - 1), "sample_id": i} for i, n in enumerate((3, 4))
    ]
    batch = PaddingFreeCollator(static_shape=StaticShape(tokens=16, segments=4, max_seqlen=16))([samples])
    assert T.real_token_count([batch]) == 7 and batch["input_ids"].numel() == 16
    assert T.supervised_count([batch]) == 5
    stats = T.static_stats([[batch]], [(7, 5)])
    assert stats == {
        "static_tokens": 16,
        "static_segments": 4,
        "static_max_seqlen": 16,
        "pad_fraction": 9 / 16,
    }
    moved = T.to_device(batch, "cpu", T.keep_cpu_keys("varpack_lce_static_graphs"))
    assert "sample_ids" not in moved  # bookkeeping never reaches the model
    assert moved["varlen_meta"] is batch["varlen_meta"]  # on the CPU: the meta itself
    assert moved["cu_seq_lens_q"] is moved["varlen_meta"].cu_seqlens_q


def test_cuda_graphs_refused_off_cuda():
    from varpack.models import load_model

    model = load_model("tiny-qwen3", vocab_size=64, attn_backend="sdpa")
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        T.apply_step_options(model, "varpack_lce_static_graphs")
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in model.modules())
    from torch._inductor import config

    if hasattr(config.triton, "cudagraph_or_error"):  # a capture that fails is an error, not an eager run
        with T.step_context("varpack_lce_static_graphs"):
            assert config.triton.cudagraph_or_error
        with T.step_context("varpack_lce_static_compile_ops"):
            assert not config.triton.cudagraph_or_error


def test_a_row_names_its_own_attention_backend():
    assert T.split_backend("varpack_lce_static_graphs@triton_short") == (
        "varpack_lce_static_graphs",
        "triton_short",
    )
    assert T.split_backend("trl_varpack@sdpa") == ("trl_varpack", "sdpa")
    assert T.split_backend("hf_fa4") == ("hf_fa4", None)
    for bad in ("hf_fa4@sdpa", "padded@flex"):
        with pytest.raises(ValueError, match="only varpack"):
            T.split_backend(bad)
    assert T.split_backend("varpack@auto") == ("varpack", "auto")
    # a varpack row with no, a misspelled or a doubled backend: the backend is named, not the row
    for bad, name in (
        ("varpack_lce@", "''"),
        ("varpack@nonexistent", "'nonexistent'"),
        ("varpack@sdpa@flex", "'sdpa@flex'"),
    ):
        with pytest.raises(
            ValueError, match=f"unknown attention backend {name} after '@'; choose 'auto' or one of"
        ):
            T.split_backend(bad)


def test_small_run_with_a_backend_per_row_and_short_samples(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc = T.main(
        ["--device", "cpu", "--small", "--steps", "2", "--rounds", "1", "--timed-passes", "1",
         "--max-sample-length", "200", "--configs", "varpack@sdpa,varpack@reference", "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    rows = {r["config"]: r for r in data["rows"]}
    assert set(rows) == {"varpack@sdpa", "varpack@reference"}
    assert rows["varpack@sdpa"]["attention"] == "varpack sdpa"
    assert rows["varpack@reference"]["attention"] == "varpack reference"
    assert rows["varpack@reference"]["attn_resolved"] == "reference"  # the row's backend, not auto's pick
    # the same samples and weights: the first-step losses agree across backends
    assert abs(rows["varpack@sdpa"]["loss_first"] - rows["varpack@reference"]["loss_first"]) < 1e-4
    assert data["workload"]["max_sample_length"] == 200 and data["workload"]["sample_length_max"] <= 200
    assert data["workload"]["samples_longer_than_max_sample_length_skipped"] > 0
    assert data["workload"]["steps"] == 2  # --small caps --steps at 4, never raises the 2 asked for


def test_unknown_backend_suffix_is_refused(capsys):
    with pytest.raises(SystemExit):
        T.main(["--device", "cpu", "--small", "--configs", "hf_sdpa@flex"])
    assert "only varpack" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--configs", "varpack@nonexistent"], "unknown attention backend 'nonexistent' after '@'"),
        (
            ["--configs", "varpack", "--attn-backend", "nonexistent"],
            "--attn-backend: unknown attention backend",
        ),
    ],
)
def test_unknown_backend_name_is_refused_before_any_row_runs(argv, message, capsys):
    # before the fix: the run started and the row failed (exit 0) after every other row had run
    with pytest.raises(SystemExit) as exc:
        T.main(["--device", "cpu", "--small", *argv])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err and "running" not in captured.out


def test_graphs_inductor_options_parsed_and_checked_before_any_row_runs(capsys):
    assert T.inductor_options_arg("") == {}
    assert T.inductor_options_arg("max_autotune=True, coordinate_descent_tuning=True,") == {
        "max_autotune": True, "coordinate_descent_tuning": True
    }
    assert T.inductor_options_arg("max_autotune=True,max_autotune_gemm_backends=ATEN,TRITON") == {
        "max_autotune": True, "max_autotune_gemm_backends": "ATEN,TRITON"
    }
    assert T.inductor_options_arg("coordinate_descent_search_radius=2") == {"coordinate_descent_search_radius": 2}
    for text, message in (
        ("max_autotune", "expected key=value items"),
        ("=True", "expected key=value items"),
        ("max_autotun=True", "unknown inductor option(s) ['max_autotun']"),
        ("triton.cudagraphs=False", "would not capture them"),
        ("max_autotune=true", "max_autotune='true' (expects bool)"),
        ("max_autotune=True,coordinate_descent_tuning", "max_autotune='True,coordinate_descent_tuning' (expects"),
    ):
        with pytest.raises(SystemExit) as exc:
            T.main(["--device", "cpu", "--small", "--graphs-inductor-options", text])
        assert exc.value.code == 2
        captured = capsys.readouterr()
        assert message in captured.err and "running" not in captured.out, text


def test_two_spellings_of_one_row_are_refused(capsys):
    """``varpack`` runs ``--attn-backend`` (auto by default): beside ``varpack@auto`` it would be timed
    twice."""
    with pytest.raises(SystemExit):
        T.main(["--device", "cpu", "--small", "--configs", "varpack,varpack@auto"])
    assert "run the same thing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        T.main(["--device", "cpu", "--small", "--attn-backend", "sdpa", "--configs", "varpack@sdpa,varpack"])
    assert "run the same thing" in capsys.readouterr().err


def test_budget_with_a_fake_clock():
    now = [100.0]
    b = T.Budget(10.0, clock=lambda: now[0])
    assert not b.spent()
    now[0] = 109.9
    assert not b.spent()
    now[0] = 110.0
    assert b.spent() and "--time-budget 10 s" in b.reason()
    assert not T.Budget(None, clock=lambda: 1e9).spent()  # no budget: never spent


def test_spent_budget_skips_every_config_and_still_writes_the_table(tmp_path, capsys):
    out = tmp_path / "train.json"
    rc = T.main(
        ["--small", "--device", "cpu", "--configs", "hf_sdpa,varpack_lce", "--rounds", "2",
         "--time-budget", "0", "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["partial"] is False
    rows = {r["config"]: r for r in data["rows"]}
    assert set(rows) == {"hf_sdpa", "varpack_lce"}
    for r in rows.values():
        assert "real_tokens_per_s" not in r
        assert all(x["error"].startswith("skipped: --time-budget 0 s") for x in r["rounds"])
    assert "(after round 1)" in capsys.readouterr().out


def test_finished_rows_are_written_before_the_end(tmp_path, monkeypatch):
    out = tmp_path / "train.json"
    seen = []
    real_run = T.run_config

    def run_and_look(config, *a, **k):
        if out.exists():  # what a wall-clock kill would leave at this point
            seen.append(
                [r["config"] for r in json.loads(out.read_text())["rows"] if "real_tokens_per_s" in r]
            )
        return real_run(config, *a, **k)

    monkeypatch.setattr(T, "run_config", run_and_look)
    argv = [
        "--small",
        "--device",
        "cpu",
        "--configs",
        "hf_sdpa,varpack_lce",
        "--rounds",
        "1",
        "--out",
        str(out),
    ]
    assert T.main(argv) == 0
    assert seen == [["hf_sdpa"]]  # before varpack_lce ran, hf_sdpa's finished row was on disk
    assert json.loads(out.read_text())["partial"] is False


def test_negative_or_nan_budget_is_refused(capsys):
    for bad in ("-3", "nan"):
        with pytest.raises(SystemExit) as exc:
            T.main(["--small", "--device", "cpu", "--configs", "hf_sdpa", "--time-budget", bad])
        assert exc.value.code == 2
        assert "--time-budget must be a number of seconds >= 0" in capsys.readouterr().err


def test_a_row_measured_in_one_round_of_two_says_which_round_is_missing(monkeypatch, capsys):
    """hf_sdpa runs in round 1, then the budget is spent: its row shows round 1's numbers and says that round
    2 was not measured (the footer says 2 rounds)."""

    class SpentAfterFirst(T.Budget):
        calls = 0

        def spent(self) -> bool:
            SpentAfterFirst.calls += 1
            return SpentAfterFirst.calls > 1

    monkeypatch.setattr(T, "Budget", SpentAfterFirst)
    rc = T.main(
        [
            "--small",
            "--device",
            "cpu",
            "--configs",
            "hf_sdpa,varpack_lce",
            "--rounds",
            "2",
            "--time-budget",
            "60",
        ]
    )
    assert rc == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| hf_sdpa |")]
    row = rows[-1]  # the final table's
    assert "round 2 not measured (skipped: --time-budget 60 s spent before it started)" in row
    assert "1.00 (1.00)" in row  # round 1's ratio only


def test_target_line_needs_every_round_and_exact_configs_only():
    rows = [
        {
            "config": "hf_fa4_liger",
            "real_tokens_per_s": 53000.0,
            "vs_best_peer_rounds": [1.0, 1.0],
            "mfu": 0.19,
        },
        {
            "config": "varpack_lce_compile",
            "real_tokens_per_s": 81000.0,
            "vs_best_peer_rounds": [1.55, 1.49],
            "best_peer_rounds": ["hf_fa4_liger", "hf_fa4_liger"],
            "mfu": 0.41,
        },
        {
            "config": "varpack",
            "real_tokens_per_s": 50000.0,
            "vs_best_peer_rounds": [0.94, 0.95],
            "best_peer_rounds": ["hf_fa4_liger", "hf_fa4_liger"],
            "mfu": 0.2,
        },
    ]
    line = T.target_line(rows)
    assert "varpack_lce_compile" in line and "1.55 / 1.49x" in line
    assert "target 1.5x: not met" in line  # round 2 fell short: not met
    assert "target 40%: MET" in line
    rows[1]["vs_best_peer_rounds"] = [1.55, 1.52]
    assert "target 1.5x: MET" in T.target_line(rows)
    assert T.target_line([rows[0]]) is None  # no varpack row
    assert T.target_line([{"config": "varpack", "error": "skipped"}]) is None


def test_target_line_not_met_when_a_round_failed():
    def row(config, tps):
        return {"config": config, "real_tokens_per_s": tps, "step_ms": 1.0, "supervised_tokens_per_s": tps,
                "mfu": 0.45, "cold_first_step_s": 1.0, "cold_pass_s": 1.0}  # fmt: skip

    first = [row("hf_fa4", 10000.0), row("varpack_lce_compile", 20000.0)]
    for second, mfu in (
        (
            [row("hf_fa4", 10000.0), {"config": "varpack_lce_compile", "error": "CUDA out of memory"}],
            "not met",
        ),
        ([{"config": "hf_fa4", "error": "CUDA out of memory"}, row("varpack_lce_compile", 20000.0)], "MET"),
    ):
        line = T.target_line(merge_rounds([first, second], "real_tokens_per_s", T.PEERS))
        assert "no ratio in 1 of 2 rounds" in line
        assert "target 1.5x: not met" in line and f"target 40%: {mfu}" in line
    assert "target 1.5x: MET" in T.target_line(merge_rounds([first, first], "real_tokens_per_s", T.PEERS))


def test_lm_head_rows_share_and_the_mfu_counting_only_those_rows():
    """``--lm-head-rows supervised`` (the default, what varpack sft runs): the row says which share of the rows
    the LM head ran (the labels rounded up to SUPERVISED_ROWS_MULTIPLE per micro-batch, at most T) and the MFU
    counting only those; ``all`` and the HF rows run every row."""
    import argparse

    import torch

    from varpack.ops.linear_ce import SUPERVISED_ROWS_MULTIPLE as M

    class Head:
        def get_output_embeddings(self):
            return torch.nn.Linear(4, 10, bias=False)  # V * D = 40

    def mb(tokens, labelled):
        labels = torch.full((1, tokens), -100)
        labels[0, 1 : 1 + labelled] = 7
        return {"input_ids": torch.zeros(1, tokens, dtype=torch.long), "labels": labels}

    steps = [[mb(4 * M, M + 1)], [mb(4 * M, 4 * M - 1)]]  # 2M rows, then all 4M (capped at T)
    labelled = [[T.labelled_count(m) for m in st] for st in steps]
    assert labelled == [[M + 1], [4 * M - 1]]
    real, seconds = 8 * M, 2.0
    row = {"real_tokens_per_s": real / seconds, "seconds": seconds, "mfu": 0.5}
    args = argparse.Namespace(lm_head_rows="supervised", peak_flops=1e3)
    got = T.lm_head_figures(row, Head(), steps, labelled, "varpack_lce_static_graphs", args)
    assert got["lm_head_rows_fraction"] == pytest.approx(6 / 8)
    assert got["mfu_lm_head_rows_run"] == pytest.approx(0.5 - 6 * 40 * (2 * M) / seconds / 1e3)
    for config, rows in (("varpack_lce_static_graphs", "all"), ("hf_fa4", "supervised")):
        full = T.lm_head_figures(row, Head(), steps, labelled, config, argparse.Namespace(lm_head_rows=rows, peak_flops=1e3))
        assert full == {"lm_head_rows_fraction": 1.0, "mfu_lm_head_rows_run": 0.5}


@pytest.mark.parametrize("rows", ["supervised", "all"])
def test_linear_ce_rows_get_the_label_count_as_max_supervised(rows, monkeypatch):
    import argparse

    import varpack.ops.linear_ce as lce

    seen = []
    monkeypatch.setattr(lce, "causal_lm_forward_with_linear_ce", lambda model, mb, **kw: seen.append(kw["max_supervised"]))
    args = argparse.Namespace(lce_backend="chunked", device="cpu", chunk_size=64, lm_head_rows=rows)
    fn, desc = T.make_loss_fn("varpack_lce", args)
    fn(None, {}, 10, 123)
    assert seen == [123 if rows == "supervised" else None]
    assert ("supervised rows" in desc) == (rows == "supervised")


def test_static_empty_pads_option(monkeypatch):
    """--static-empty-pads: ``on`` gives zero-length pad segments (T = the longest pack), and is refused for a
    backend or a model not known to take them; ``off`` never; ``auto`` as varpack sft (EMPTY_PADS_BY_DEFAULT)."""
    import argparse
    import types

    from varpack.integrations import cuda_graphs
    from varpack.plan import plan_packs

    ds = types.SimpleNamespace(plan=plan_packs([64, 30, 20, 14, 64, 3, 3], 64))

    def shape(mode, backend="triton_short", model="tiny-qwen3"):
        args = argparse.Namespace(static_empty_pads=mode, attn_backend=backend, static_multiple_of=64,
                                  static_segments=None, model=model, vocab_size=None)  # fmt: skip
        return T.static_shape_for(ds, args)

    assert shape("on").empty_pads and shape("on").tokens == 64
    assert not shape("off").empty_pads and shape("off").tokens == 128
    with pytest.raises(ValueError, match="'flash_attn_4' with tiny-qwen3 is not known to take zero-length segments"):
        shape("on", "flash_attn_4")
    with pytest.raises(ValueError, match="with tiny-qwen3.5 is not known to take zero-length segments"):
        shape("on", model="tiny-qwen3.5")  # recurrent layers
    assert shape("auto").empty_pads == cuda_graphs.EMPTY_PADS_BY_DEFAULT
    monkeypatch.setattr(cuda_graphs, "EMPTY_PADS_BY_DEFAULT", True)
    assert shape("auto").empty_pads and not shape("auto", "auto").empty_pads and not shape("off").empty_pads
    monkeypatch.setattr(cuda_graphs, "EMPTY_PADS_BY_DEFAULT", False)
    assert not shape("auto").empty_pads and shape("auto").tokens == 128 and shape("on").empty_pads


def test_graphs_row_attention_as_varpack_sft_chooses_it(monkeypatch):
    """A ``_graphs`` row asks varpack sft's ``graph_attention`` (meta model, the plan's static max_seqlen): its
    backend and note are the row's; a refusal is an error naming it, never a row captured on a backend a
    captured layer cannot run (``auto`` -> ``sdpa`` fails inside the capture with a CPU-copy error)."""
    import argparse
    import types

    from varpack.integrations import cuda_graphs
    from varpack.plan import plan_packs

    ds = types.SimpleNamespace(plan=plan_packs([64, 30, 20, 14, 64, 3, 3], 64))
    args = argparse.Namespace(model="tiny-qwen3", vocab_size=None, attn_backend="auto", device="cuda",
                              dtype="bfloat16")  # fmt: skip
    seen = []

    def fake(model, *, backend, device, dtype, max_seqlen):
        seen.append((type(model).__name__, backend, device, dtype, max_seqlen))
        return answer

    monkeypatch.setattr(cuda_graphs, "graph_attention", fake)
    answer = ("triton_short", None, "attention triton_short in the captured layers (auto resolves to sdpa)")
    assert T.graph_attention_for(ds, args) == ("triton_short", answer[2])
    assert seen == [("Qwen3ForCausalLM", "auto", "cuda", T.torch.bfloat16, StaticShape.from_plan(ds.plan).max_seqlen)]
    answer = ("flash_attn_4", None, None)
    assert T.graph_attention_for(ds, args) == ("flash_attn_4", None)
    answer = ("auto", "attention 'auto' resolves to sdpa here", None)
    with pytest.raises(ValueError, match="CUDA graphs with attention 'auto' resolves to sdpa here"):
        T.graph_attention_for(ds, args)
    row = {"graph_attention": "attention triton_short in the captured layers (x)", "attention": "varpack triton_short"}
    assert "attention triton_short in the captured layers (x)" in T.note(row)


def test_attention_flops_count_each_samples_causal_pairs():
    """12 * layers * heads * head_dim * sum L(L+1)/2: a pack of two samples counts their own pairs, not the
    pack's; only full-attention layers count; a sliding window is not counted at all (None)."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, head_dim=8, hidden_size=16)
    assert T.attention_flops(cfg, [3, 1]) == 12 * 2 * 4 * 8 * (6 + 1)
    assert T.attention_flops(cfg, [4]) == 12 * 2 * 4 * 8 * 10 > T.attention_flops(cfg, [3, 1])
    no_head_dim = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=16, head_dim=None)
    assert T.attention_flops(no_head_dim, [2]) == 12 * 2 * 4 * 4 * 3
    hybrid = SimpleNamespace(**vars(cfg), layer_types=["linear_attention", "full_attention"])
    assert T.attention_flops(hybrid, [3, 1]) == T.attention_flops(cfg, [3, 1]) / 2
    sliding = SimpleNamespace(**vars(cfg), layer_types=["sliding_attention", "full_attention"])
    assert T.attention_flops(sliding, [3]) is None
    assert T.attention_flops(SimpleNamespace(**vars(cfg), use_sliding_window=True, sliding_window=4), [3]) is None


def test_small_run_reports_mfu_with_attention(tmp_path):
    out = tmp_path / "t.json"
    assert T.main(["--device", "cpu", "--small", "--configs", "varpack_lce", "--rounds", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    row, attn = data["rows"][0], data["workload"]["attention_flops_per_step"]
    assert attn > 0
    dense = 6.0 * row["n_params"] * row["real_tokens_per_s"]
    assert row["mfu"] == pytest.approx(dense / 989e12)
    assert row["mfu_with_attention"] == pytest.approx((dense + attn * row["timed_steps"] / row["seconds"]) / 989e12)
