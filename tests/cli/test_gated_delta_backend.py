"""`--gated-delta-backend` of `varpack sft` and `varpack check`: parsing, the value reaching the
patched Gated DeltaNet layers (and their forward), refusals that name the option, the `linear` report line,
and the saved varpack_config.yaml. CPU only, tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from varpack.check import check_exactness
from varpack.cli.main import build_parser, main
from varpack.models import load_model
from varpack.models.registry import is_gated_delta_layer
from varpack.ops.gated_delta_rule import dispatch
from varpack.train import SFTConfig, build_sft, run_sft
from varpack.train.cli_flags import config_from_args
from varpack.train.config_file import CONFIG_FILE_NAME, load_config_file, write_config_file

VOCAB = 512
BACKENDS = ("fla", "fla_hybrid", "chunk", "chunk_compiled", "naive")


def _samples(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (4 + 3 * i,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100, *ids[1:]], "length": len(ids)})
    return out


class _Tok:
    pad_token_id = 0

    def save_pretrained(self, path):
        Path(path, "tokenizer.json").write_text("{}")


def _layer_backends(model) -> set[str]:
    layers = [m for m in model.modules() if is_gated_delta_layer(m)]
    assert layers, "the model has no Gated DeltaNet layers"
    return {getattr(m, "_varpack_gdn_backend", None) for m in layers}


@pytest.fixture
def naive_calls(monkeypatch):
    """Counts the packed forwards that reach the naive gated delta rule (dispatch calls it by this name)."""
    calls = []
    real = dispatch.naive_recurrent_gated_delta_rule

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatch, "naive_recurrent_gated_delta_rule", spy)
    return calls


def _config(tmp_path, **kw):
    base = dict(
        model="tiny-qwen3.5",
        output_dir=str(tmp_path / "out"),
        packing_length=32,
        attn_backend="reference",
        max_steps=1,
        save=False,
        extra_training_args={"use_cpu": True, "optim": "sgd"},
    )
    base.update(kw)
    return SFTConfig(**base)


# ------------------------------------------------------------------------------------------------------
# parsing and config files
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["auto", *BACKENDS])
def test_flag_parses_for_sft_and_check(value):
    parser = build_parser()
    assert (
        config_from_args(parser.parse_args(["sft", "--gated-delta-backend", value])).gated_delta_backend
        == value
    )
    assert (
        config_from_args(parser.parse_args(["sft", "--gated_delta_backend", value])).gated_delta_backend
        == value
    )
    assert parser.parse_args(["check", "--gated-delta-backend", value]).gated_delta_backend == value


def test_default_is_auto():
    parser = build_parser()
    assert config_from_args(parser.parse_args(["sft"])).gated_delta_backend == "auto"
    assert parser.parse_args(["check"]).gated_delta_backend == "auto"
    assert SFTConfig().gated_delta_backend == "auto"


@pytest.mark.parametrize("cmd", ["sft", "check"])
def test_bad_value_is_a_usage_error(cmd, capsys):
    code = main([cmd, "--gated-delta-backend", "flash"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"usage: varpack {cmd}")
    assert "argument --gated-delta-backend: invalid choice: 'flash'" in err and "'fla_hybrid'" in err


def test_config_refuses_a_bad_value():
    with pytest.raises(ValueError, match=r"SFTConfig\.gated_delta_backend has an invalid value: 'flash'"):
        SFTConfig(gated_delta_backend="flash")


@pytest.mark.parametrize("key", ["gated_delta_backend", "gated-delta-backend"])
def test_yaml_round_trip(tmp_path, key):
    path = tmp_path / "run.yaml"
    path.write_text(f"model: tiny-qwen3.5\n{key}: naive\n")
    assert load_config_file(path).gated_delta_backend == "naive"
    parsed = config_from_args(build_parser().parse_args(["sft", "--config", str(path)]))
    assert parsed.gated_delta_backend == "naive"
    # a flag overrides the file
    flag = config_from_args(
        build_parser().parse_args(["sft", "--config", str(path), "--gated-delta-backend", "chunk"])
    )
    assert flag.gated_delta_backend == "chunk"
    written = write_config_file(SFTConfig(gated_delta_backend="chunk_compiled"), tmp_path / "w.yaml")
    assert "gated_delta_backend: chunk_compiled" in written.read_text()
    assert load_config_file(written) == SFTConfig(gated_delta_backend="chunk_compiled")


def test_yaml_bad_value_names_the_key(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("gated_delta_backend: flash\n")
    code = main(["sft", "--config", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and "gated_delta_backend" in err and "flash" in err


# ------------------------------------------------------------------------------------------------------
# varpack check
# ------------------------------------------------------------------------------------------------------
def test_check_sets_the_layers_and_runs_the_forced_backend(naive_calls):
    model = load_model("tiny-qwen3.5", vocab_size=VOCAB, attn_backend="reference")
    res = check_exactness(model, _samples(3), backend="reference", gated_delta_backend="naive")
    assert res["passed"], res["failures"]
    assert _layer_backends(model) == {"naive"}
    assert (res["gated_delta_backend"], res["gated_delta_reason"]) == ("naive", "forced")
    assert naive_calls, "the packed run did not reach the naive rule"
    # control: auto replaces the forced value and does not run the naive rule on a CPU
    naive_calls.clear()
    res = check_exactness(model, _samples(3), backend="reference")
    assert _layer_backends(model) == {"auto"} and res["gated_delta_backend"] == "chunk"
    assert res["passed"] and not naive_calls


def test_check_library_refusals():
    model = load_model("tiny-qwen3.5", vocab_size=VOCAB, attn_backend="reference")
    with pytest.raises(
        ValueError, match=r"gated_delta_backend='fla_hybrid': .*fla_hybrid needs a CUDA device"
    ):
        check_exactness(model, _samples(2), backend="reference", gated_delta_backend="fla_hybrid")
    dense = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    with pytest.raises(
        ValueError, match=r"gated_delta_backend='chunk' .*Qwen3ForCausalLM has no Gated DeltaNet"
    ):
        check_exactness(dense, _samples(2), backend="reference", gated_delta_backend="chunk")


@pytest.mark.parametrize("value", ["chunk", "naive"])
def test_cli_check_forced_backend_passes_on_cpu(value, capsys):
    code = main(
        [
            "check",
            "--model",
            "tiny-qwen3.5",
            "--device",
            "cpu",
            "--gated-delta-backend",
            value,
            "--num-samples",
            "2",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "PASS" in out
    assert f"gated delta rule backend: {value} (forced: --gated-delta-backend {value})" in out


def test_cli_check_fla_hybrid_on_cpu_is_a_clear_error(capsys, monkeypatch):
    import varpack.data

    def no_encoding(*a, **k):  # refused before the data is encoded
        raise AssertionError("encoded the data")

    monkeypatch.setattr(varpack.data, "load_and_encode", no_encoding)
    code = main(
        ["check", "--model", "tiny-qwen3.5", "--device", "cpu", "--gated-delta-backend", "fla_hybrid"]
    )
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "varpack check: error: --gated-delta-backend fla_hybrid: gated delta rule backend 'fla_hybrid' cannot "
        "run on cpu: fla_hybrid needs a CUDA device, got cpu"
    )


def test_cli_check_dense_model_refused(capsys):
    code = main(["check", "--model", "tiny-qwen3", "--gated-delta-backend", "naive"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "--gated-delta-backend naive forces a gated delta rule backend" in err
    assert "model 'tiny-qwen3' (Qwen3ForCausalLM) has no Gated DeltaNet" in err


# ------------------------------------------------------------------------------------------------------
# varpack sft
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("given", [True, False], ids=["model-given", "model-loaded"])
def test_sft_sets_the_layers(tmp_path, given):
    model = load_model("tiny-qwen3.5", vocab_size=VOCAB, attn_backend="reference") if given else None
    run = build_sft(
        _config(tmp_path, gated_delta_backend="naive"), model=model, tokenizer=_Tok(), encoded=_samples()
    )
    assert _layer_backends(run.model) == {"naive"}
    assert run.gated_delta == ("naive", "forced: --gated-delta-backend")
    # control: auto
    model = load_model("tiny-qwen3.5", vocab_size=VOCAB, attn_backend="reference") if given else None
    run = build_sft(_config(tmp_path), model=model, tokenizer=_Tok(), encoded=_samples())
    assert _layer_backends(run.model) == {"auto"}
    assert run.gated_delta == ("chunk", "auto on cpu: varpack's chunked PyTorch path")


def test_sft_run_prints_the_linear_line_trains_on_it_and_saves_it(tmp_path, naive_calls):
    lines: list[str] = []
    model = load_model("tiny-qwen3.5", vocab_size=VOCAB, attn_backend="reference")
    config = _config(tmp_path, gated_delta_backend="naive", save=True)
    run = run_sft(config, print_fn=lines.append, model=model, tokenizer=_Tok(), encoded=_samples())
    assert "linear    gated delta rule: naive (forced: --gated-delta-backend)" in lines
    assert naive_calls, "training did not run the naive rule"
    saved = load_config_file(Path(config.output_dir) / CONFIG_FILE_NAME)
    assert saved.gated_delta_backend == "naive" and saved == run.config

    lines.clear()
    naive_calls.clear()
    model = load_model("tiny-qwen3.5", vocab_size=VOCAB, attn_backend="reference")
    run_sft(_config(tmp_path / "b"), print_fn=lines.append, model=model, tokenizer=_Tok(), encoded=_samples())
    assert "linear    gated delta rule: chunk (auto on cpu: varpack's chunked PyTorch path)" in lines
    assert not naive_calls


def test_sft_dense_model_has_no_linear_line(tmp_path):
    lines: list[str] = []
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    run = run_sft(
        _config(tmp_path, model="tiny-qwen3"),
        print_fn=lines.append,
        model=model,
        tokenizer=_Tok(),
        encoded=_samples(),
    )
    assert run.gated_delta is None and not [line for line in lines if line.startswith("linear")]
    assert [line for line in lines if line.startswith("model ")]  # the header is printed to this print_fn


def test_sft_refusals_name_the_option_and_the_model(tmp_path):
    dense = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    with pytest.raises(
        ValueError, match=r"gated_delta_backend='chunk' .*model 'tiny-qwen3' \(Qwen3ForCausalLM\)"
    ):
        build_sft(
            _config(tmp_path, model="tiny-qwen3", gated_delta_backend="chunk"),
            model=dense,
            tokenizer=_Tok(),
            encoded=_samples(),
        )
    gdn = load_model("tiny-qwen3.5", vocab_size=VOCAB, attn_backend="reference")
    with pytest.raises(
        ValueError, match=r"gated_delta_backend='fla_hybrid': .*cannot run on cpu: fla_hybrid needs a CUDA"
    ):
        build_sft(
            _config(tmp_path, gated_delta_backend="fla_hybrid"),
            model=gdn,
            tokenizer=_Tok(),
            encoded=_samples(),
        )


@pytest.mark.parametrize(
    ("model", "value", "expected"),
    [
        (
            "tiny-qwen3",
            "naive",
            "--gated-delta-backend naive forces a gated delta rule backend, but model 'tiny-qwen3'",
        ),
        (
            "tiny-qwen3.5",
            "fla_hybrid",
            "--gated-delta-backend fla_hybrid: gated delta rule backend 'fla_hybrid' cannot run on cpu",
        ),
    ],
)
def test_cli_sft_refuses_before_encoding(tmp_path, capsys, monkeypatch, model, value, expected):
    import varpack.train.sft as sft

    def no_encoding(*a, **k):
        raise AssertionError("encoded the data")

    monkeypatch.setattr(sft, "load_and_encode", no_encoding)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "o"
    code = main(
        [
            "sft",
            "--model",
            model,
            "--gated-delta-backend",
            value,
            "--max-steps",
            "1",
            "--output-dir",
            str(out),
        ]
    )
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err and expected in err, err
    assert not out.exists()
