"""benchmarks/train.py's static / custom-op / CUDA-graph configs (issue 18): option parsing, the boundaries' place,
real-token counting of static packs (pad tokens never counted as throughput), the CPU refusal of CUDA graphs."""

from __future__ import annotations

import pytest

from benchmarks import train as T
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
    stats = T._static_stats([[batch]], [(7, 5)])
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
    import json

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


def test_two_spellings_of_one_row_are_refused(capsys):
    """``varpack`` runs ``--attn-backend`` (auto by default): beside ``varpack@auto`` it would be timed twice."""
    with pytest.raises(SystemExit):
        T.main(["--device", "cpu", "--small", "--configs", "varpack,varpack@auto"])
    assert "run the same thing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        T.main(["--device", "cpu", "--small", "--attn-backend", "sdpa", "--configs", "varpack@sdpa,varpack"])
    assert "run the same thing" in capsys.readouterr().err
