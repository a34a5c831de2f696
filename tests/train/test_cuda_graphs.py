"""``varpack sft --cuda-graphs``: the flag and its config round trip, every refusal with its
message (never a silent fallback), the static-shape collation of sft on the CPU (== the dynamic-shape run, with a
negative control), the Trainer's CUDA-graph step hooks, the speed line; on a GPU a 3-step run whose losses equal
the run without the flag and whose layers are all captured."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch

from tests.train.test_cli_sft import VOCAB, _Tok, synthetic_samples
from varpack.cli.main import build_parser, main
from varpack.models import load_model
from varpack.train.cli_flags import config_from_args, config_to_argv
from varpack.train.config import (
    GRAPHS_AUTO_REASON,
    CompileChoice,
    SFTConfig,
    check_cuda_graphs,
    resolve_cuda_graphs,
    resolve_torch_compile,
)
from varpack.train.config_file import load_config_file, write_config_file


def _parse(*argv: str) -> SFTConfig:
    return config_from_args(build_parser().parse_args(["sft", *argv]))


# -- the flag --------------------------------------------------------------------------------------------
def test_flag_parses_and_round_trips(tmp_path):
    assert _parse().cuda_graphs == "auto"
    assert _parse("--cuda-graphs").cuda_graphs is True
    assert _parse("--cuda-graphs", "--no-cuda-graphs").cuda_graphs is False
    assert _parse("--cuda-graphs", "false").cuda_graphs is False
    assert _parse("--cuda-graphs", "auto").cuda_graphs == "auto"
    config = SFTConfig(cuda_graphs=True, seed=3)
    assert _parse(*config_to_argv(config)) == config
    path = write_config_file(config, tmp_path / "run.yaml")
    assert load_config_file(path) == config == _parse("--config", str(path))
    (tmp_path / "b.yaml").write_text("cuda_graphs: true\n")
    assert _parse("--config", str(tmp_path / "b.yaml")).cuda_graphs is True
    assert _parse("--config", str(tmp_path / "b.yaml"), "--no-cuda-graphs").cuda_graphs is False


def test_flag_resolves_compile_on():
    for value in ("auto", True):
        choice = resolve_torch_compile(SFTConfig(cuda_graphs=True, torch_compile=value), device="cuda")
        assert choice == CompileChoice(True, "--cuda-graphs")


# -- refusals ----------------------------------------------------------------------------------------------
#: fields, world_size, environment, device -> the message's fragment
REFUSALS = {
    "compile_off": (
        dict(torch_compile=False),
        1,
        {},
        "cuda",
        "with --torch-compile false (torch_compile=False)",
    ),
    "streaming": (
        dict(streaming=True, max_steps=3),
        1,
        {},
        "cuda",
        "with --streaming (streaming=True): the static",
    ),
    "packs_per_step": (dict(packs_per_step=2), 1, {}, "cuda", "with --packs-per-step 2 (packs_per_step=2): "),
    "grad_accum": (dict(grad_accum=4), 1, {}, "cuda", "with --grad-accum 4 (grad_accum=4): a step's"),
    "lora_dropout": (
        dict(lora=True, lora_dropout=0.1), 1, {}, "cuda", "with --lora-dropout 0.1 (lora_dropout=0.1): dropout"
    ),
    "attn_sdpa": (dict(attn_backend="sdpa"), 1, {}, "cuda", "with --attn-backend sdpa (attn_backend='sdpa')"),
    "attn_torch_varlen": (
        dict(attn_backend="torch_varlen"),
        1,
        {},
        "cuda",
        "with --attn-backend torch_varlen (attn_backend='torch_varlen')",
    ),
    "liger": (dict(use_liger_kernel=True), 1, {}, "cuda", "with --use-liger-kernel (use_liger_kernel=True)"),
    "checkpointing": (
        dict(gradient_checkpointing=True),
        1,
        {},
        "cuda",
        "with --gradient-checkpointing (gradient_checkpointing=True)",
    ),
    "fsdp": (dict(fsdp=True), 1, {}, "cuda", "with --fsdp (fsdp=True)"),
    "logits": (dict(loss_impl="logits"), 1, {}, "cuda", "with --loss-impl logits (loss_impl='logits')"),
    "dpo": (dict(objective="dpo"), 1, {}, "cuda", "with --objective dpo (objective='dpo')"),
    "fsdp_extra": (dict(extra_training_args={"fsdp": "full_shard"}), 1, {}, "cuda", "with FSDP"),
    "fsdp_env": (dict(), 1, {"ACCELERATE_USE_FSDP": "true"}, "cuda", "with FSDP"),
    "deepspeed": (dict(extra_training_args={"deepspeed": "ds.json"}), 1, {}, "cuda", "with DeepSpeed"),
    "deepspeed_env": (dict(), 1, {"ACCELERATE_USE_DEEPSPEED": "1"}, "cuda", "with DeepSpeed"),
    "hf_compile": (dict(extra_training_args={"torch_compile": True}), 1, {}, "cuda", "transformers' own"),
    "hf_compile_backend": (
        dict(extra_training_args={"torch_compile_backend": "inductor"}), 1, {}, "cuda", "transformers' own"
    ),
    "ranks": (dict(), 2, {}, "cuda", "with 2 ranks"),
    "cpu": (dict(), 1, {}, "cpu", "needs a CUDA GPU; this run trains on cpu"),
    "mps": (dict(), 1, {}, "mps", "needs a CUDA GPU; this run trains on mps"),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_each_refusal_names_the_flag(name):
    fields, world, env, device, fragment = REFUSALS[name]
    config = SFTConfig(cuda_graphs=True, **fields)
    with pytest.raises(ValueError, match="--cuda-graphs") as info:
        check_cuda_graphs(config, device=device, world_size=world, environ=env)
    assert fragment in str(info.value), str(info.value)
    # control: the same settings without the flag pass, and the flag alone passes on one CUDA process
    check_cuda_graphs(
        dataclasses.replace(config, cuda_graphs=False), device=device, world_size=world, environ=env
    )
    check_cuda_graphs(SFTConfig(cuda_graphs=True), device="cuda", world_size=1, environ={})


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_auto_falls_back_where_the_flag_is_refused(name):
    """``cuda_graphs="auto"`` (the default) beside each setting the flag is refused with: off, with the same
    reason, prefixed ``auto:`` (the ``speed`` line prints it); never an error. Control: auto alone on one CUDA
    process is on, and ``--cuda-graphs false`` is off."""
    fields, world, env, device, fragment = REFUSALS[name]
    choice = resolve_cuda_graphs(SFTConfig(**fields), device=device, world_size=world, environ=env)
    expected = "run; CUDA graphs need a CUDA GPU" if device != "cuda" else fragment.removeprefix("with ").split(":")[0]
    assert not choice.on and choice.reason.startswith("auto: ") and expected in choice.reason, choice
    on = resolve_cuda_graphs(SFTConfig(), device="cuda", world_size=1, environ={})
    assert on == CompileChoice(True, GRAPHS_AUTO_REASON, "--cuda-graphs false for dynamic shapes")
    assert not resolve_cuda_graphs(SFTConfig(cuda_graphs=False), device="cuda", environ={}).on
    # a forced flag is refused, not turned off
    with pytest.raises(ValueError, match="--cuda-graphs"):
        resolve_cuda_graphs(SFTConfig(cuda_graphs=True, **fields), device=device, world_size=world, environ=env)


def test_torch_compile_reads_the_resolved_graph_choice():
    """``torch_compile="auto"`` follows graphs only once they are resolved on: ``cuda_graphs="auto"`` itself
    does not force compile (a CPU run stays eager)."""
    assert resolve_torch_compile(SFTConfig(), device="cpu").on is False
    assert resolve_torch_compile(SFTConfig(cuda_graphs=True), device="cpu") == CompileChoice(True, "--cuda-graphs")


@pytest.mark.parametrize(
    ("flags", "shown"),
    [
        (["--lora", "--lora-dropout", "0.1"], "--cuda-graphs with --lora-dropout 0.1 (lora_dropout=0.1): dropout"),
        (["--packs-per-step", "2"], "--cuda-graphs with --packs-per-step 2 (packs_per_step=2): the static"),
        (
            ["--no-torch-compile"],
            "--cuda-graphs with --torch-compile false (torch_compile=False): CUDA graphs",
        ),
        (
            ["--attn-backend", "sdpa"],
            "--cuda-graphs with --attn-backend sdpa (attn_backend='sdpa'): captured",
        ),
    ],
)
def test_cli_refusal_names_the_flag_and_the_field(flags, shown, tmp_path, capsys):
    """A CLI user typed a flag and read only the config field in the refusal (a fresh user's review): it
    names the flag as typed and the config field (a --config file's key), each once. It comes before the data
    is encoded, so no GPU is needed to see it."""
    rc = main(["sft", "--cuda-graphs", *flags, "--model", "tiny-qwen3", "--output-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 1 and f"varpack sft: error: {shown}" in err, (rc, err)


def test_build_sft_refuses_on_a_cpu_before_encoding(tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the CPU refusal needs a machine without CUDA")
    from varpack.train import sft

    def never(*a, **k):  # the refusal comes before minutes of encoding
        raise AssertionError("encoded before refusing")

    monkeypatch.setattr(sft, "load_and_encode", never)
    config = SFTConfig(model="tiny-qwen3", output_dir=str(tmp_path / "o"), cuda_graphs=True, save=False)
    with pytest.raises(ValueError, match="--cuda-graphs needs a CUDA GPU; this run trains on cpu"):
        sft.build_sft(config)
    assert not (tmp_path / "o").exists()


def test_build_sft_refuses_float32_training_before_encoding(tmp_path, monkeypatch):
    """A model loaded by name in float32 without --bf16 is refused before the encoding (it was refused only
    after encoding and loading, minutes with real data); --bf16 or --dtype bfloat16 gets past this check."""
    from varpack.train import sft

    def never(*a, **k):
        raise AssertionError("encoded before refusing")

    monkeypatch.setattr(sft, "load_and_encode", never)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the CUDA check, to the dtype one
    config = SFTConfig(model="tiny-qwen3", output_dir=str(tmp_path / "o"), cuda_graphs=True, save=False)
    with pytest.raises(ValueError, match="--cuda-graphs with float32 training.*--bf16"):
        sft.build_sft(config)
    for ok in (dataclasses.replace(config, bf16=True), dataclasses.replace(config, dtype="bfloat16")):
        with pytest.raises(AssertionError, match="encoded before refusing"):  # reached the encoding
            sft.build_sft(ok)


def test_cli_refuses_on_a_cpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("the CPU refusal needs a machine without CUDA")
    rc = main(["sft", "--cuda-graphs", "--model", "tiny-qwen3", "--output-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 1 and "--cuda-graphs needs a CUDA GPU" in err, (rc, err)


@pytest.mark.parametrize(
    ("name", "fragment"), [("tiny-qwen3-vl", "vision-language"), ("tiny-qwen3.5", "Gated DeltaNet")]
)
def test_models_it_is_not_shown_for_are_refused(name, fragment):
    from varpack.train.sft import _refuse_graph_model

    with pytest.raises(ValueError, match=f"--cuda-graphs with .*{fragment}"):
        _refuse_graph_model(load_model(name), autocast=True)
    dense = load_model("tiny-qwen3", vocab_size=VOCAB)
    _refuse_graph_model(dense, autocast=True)  # control: a dense text model under autocast passes
    with pytest.raises(ValueError, match="--cuda-graphs with float32 training"):
        _refuse_graph_model(dense)  # and without autocast its float32 weights are refused


def test_float32_training_is_refused_with_the_fix_named(monkeypatch):
    """float32 attention has no capturable backend with a backward through the op (auto reached sdpa, whose
    host read of cu_seqlens failed inside the capture on the H200 with a CUDA-copy error): refused before
    compiling, naming --bf16 / --dtype bfloat16. Controls: --bf16 and a bf16 model get past the check."""
    from varpack.integrations import cuda_graphs
    from varpack.train.sft import _prepare_model

    compiled = []
    monkeypatch.setattr(cuda_graphs, "compile_layers_as_graphs", lambda model, **kw: compiled.append(kw) or 0)
    config = SFTConfig(cuda_graphs=True, torch_compile=True)
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="sdpa")
    with pytest.raises(ValueError, match="--cuda-graphs with float32 training.*--bf16"):
        _prepare_model(config, model, lambda: model, device="cuda")
    assert not compiled
    _prepare_model(dataclasses.replace(config, bf16=True), model, lambda: model, device="cuda")
    bf16_model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="sdpa", dtype=torch.bfloat16)
    _prepare_model(config, bf16_model, lambda: bf16_model, device="cuda")
    assert len(compiled) == 2


def test_compile_for_graphs_refuses_a_cpu_device():
    from varpack.integrations.cuda_graphs import compile_layers_as_graphs

    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="sdpa")
    with pytest.raises(
        ValueError, match="--cuda-graphs: CUDA graphs need a CUDA device, the model is on cpu"
    ):
        compile_layers_as_graphs(model, what="--cuda-graphs")
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in model.modules())


def test_graph_compile_kw_takes_inductor_options_in_place_of_the_mode(monkeypatch):
    """Inductor options replace ``mode="reduce-overhead"`` with CUDA graphs kept on; an unknown option or
    ``triton.cudagraphs=False`` is an error naming it, raised before any layer is compiled."""
    from varpack.integrations import cuda_graphs, kernels

    assert cuda_graphs.graph_compile_kw() == cuda_graphs.GRAPH_COMPILE_KW
    assert cuda_graphs.graph_compile_kw() is not cuda_graphs.GRAPH_COMPILE_KW
    kw = cuda_graphs.graph_compile_kw({"max_autotune": True, "coordinate_descent_tuning": True})
    assert "mode" not in kw and kw["options"] == {
        "max_autotune": True, "coordinate_descent_tuning": True, "triton.cudagraphs": True
    }
    assert {k: kw[k] for k in ("custom_ops", "fullgraph", "dynamic")} == {
        "custom_ops": True, "fullgraph": True, "dynamic": False
    }
    with pytest.raises(ValueError, match=r"unknown inductor option\(s\) \['max_autotun'\]"):
        cuda_graphs.graph_compile_kw({"max_autotun": True})
    with pytest.raises(ValueError, match=r"wrong type: max_autotune='true' \(expects bool\)"):
        cuda_graphs.graph_compile_kw({"max_autotune": "true"})
    with pytest.raises(ValueError, match=r"coordinate_descent_search_radius=2.0 \(expects int\)"):
        cuda_graphs.graph_compile_kw({"coordinate_descent_search_radius": 2.0})
    with pytest.raises(ValueError, match=r"mix_order_reduction_split_size='64' \(expects int \| NoneType\)"):
        cuda_graphs.graph_compile_kw({"triton.mix_order_reduction_split_size": "64"})
    assert cuda_graphs.graph_compile_kw({"triton.mix_order_reduction_split_size": None})
    assert cuda_graphs.graph_compile_kw({"coordinate_descent_search_radius": 2})["options"] == {
        "coordinate_descent_search_radius": 2, "triton.cudagraphs": True
    }
    with pytest.raises(ValueError, match="triton.cudagraphs=False would not capture them"):
        cuda_graphs.graph_compile_kw({"triton.cudagraphs": False})
    seen = []
    monkeypatch.setattr(kernels, "compile_layers", lambda model, **kw: seen.append(kw) or 2)
    dense = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="sdpa")
    with pytest.raises(ValueError, match="unknown inductor option"):
        cuda_graphs.compile_layers_as_graphs(dense, device="cuda", inductor_options={"no_such_option": 1})
    assert seen == []
    assert cuda_graphs.compile_layers_as_graphs(dense, device="cuda", inductor_options={"max_autotune": True}) == 2
    assert seen == [
        {"custom_ops": True, "fullgraph": True, "dynamic": False,
         "options": {"max_autotune": True, "triton.cudagraphs": True}}
    ]  # fmt: skip


def test_graph_compile_kw_takes_every_inductor_options_own_value():
    """No false refusal: each inductor option set to its current value passes the name and type checks."""
    from torch._inductor import config as inductor_config
    from torch._inductor import list_options

    from varpack.integrations.cuda_graphs import graph_compile_kw

    values = inductor_config.get_config_copy()
    checked = [key for key in list_options() if key in values and key != "triton.cudagraphs"]
    assert len(checked) > 100
    for key in checked:
        assert graph_compile_kw({key: values[key]})["options"][key] is values[key], key


def test_compile_for_graphs_gated_delta_models_need_fla_hybrid(monkeypatch):
    """A Gated DeltaNet model runs captured only where its rule resolves to fla_hybrid (chunk tables built on
    the device): on the chunk backend, or off CUDA, it is refused before compiling, with the backend it
    resolved to; with fla_hybrid resolvable (its probe stood in) it is compiled and its Gated DeltaNet layers
    are marked to trace without CPU offsets. A dense model gets past the check (the control)."""
    from varpack.integrations.cuda_graphs import (
        GATED_DELTA_GRAPHS_REFUSAL,
        compile_layers_as_graphs,
        model_refusal,
    )
    from varpack.integrations.transformers import enable_varpack
    from varpack.models.gated_delta import tiny_model
    from varpack.models.registry import is_gated_delta_layer
    from varpack.ops.gated_delta_rule import dispatch

    hybrid = tiny_model("tiny-qwen3.5", seed=1, vocab_size=VOCAB)
    enable_varpack(hybrid, linear_backend="chunk")
    assert model_refusal(hybrid, autocast=True, device="cuda") == (
        f"Qwen3_5ForCausalLM: {GATED_DELTA_GRAPHS_REFUSAL}; gated delta rule backend 'chunk' resolves to 'chunk' "
        "here"
    )
    assert model_refusal(hybrid, autocast=True, device="cpu").endswith("which needs a CUDA device (here: cpu)")
    with pytest.raises(ValueError, match=r"--cuda-graphs with Qwen3_5ForCausalLM: its recurrent mixers \(Gated"):
        compile_layers_as_graphs(hybrid, device="cuda", what="--cuda-graphs")
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in hybrid.modules())
    assert not any(getattr(m, "_varpack_static_boundaries", False) for m in hybrid.modules())

    monkeypatch.setattr(dispatch, "_fla_hybrid_capability", lambda device, dims=None: (False, "fla-core missing"))
    forced = model_refusal(hybrid, autocast=True, device="cuda", gated_delta_backend="fla_hybrid")
    assert forced is not None and forced.endswith("RuntimeError: gated delta rule backend 'fla_hybrid' cannot run on cuda: fla-core missing")
    monkeypatch.setattr(dispatch, "_fla_hybrid_capability", lambda device, dims=None: (True, "ok"))
    enable_varpack(hybrid, linear_backend="fla_hybrid")
    assert model_refusal(hybrid, autocast=True, device="cuda") is None
    assert compile_layers_as_graphs(hybrid, device="cuda") == hybrid.config.num_hidden_layers
    gdn = [m for m in hybrid.modules() if is_gated_delta_layer(m)]
    assert gdn and all(m._varpack_static_boundaries for m in gdn)
    # auto takes it where fla_hybrid runs, as for a dense model; where the rule resolves elsewhere, auto falls
    # back naming the backend and a forced flag is an error naming it
    from varpack.train import sft

    args = types.SimpleNamespace(device=torch.device("cuda"), world_size=1, bf16=True, fp16=False)
    choice, _, _ = sft._resolve_graphs(SFTConfig(gated_delta_backend="fla_hybrid"), hybrid, None, args)
    assert choice.on and choice.reason == GRAPHS_AUTO_REASON, choice
    assert sft._resolve_graphs(SFTConfig(cuda_graphs=True, gated_delta_backend="fla_hybrid"), hybrid, None, args)[0].on
    choice, _, _ = sft._resolve_graphs(SFTConfig(gated_delta_backend="chunk"), hybrid, None, args)
    assert not choice.on and choice.reason.startswith("auto: Qwen3_5ForCausalLM: its recurrent mixers"), choice
    assert choice.reason.endswith("gated delta rule backend 'chunk' resolves to 'chunk' here"), choice
    with pytest.raises(ValueError, match=r"^--cuda-graphs with Qwen3_5ForCausalLM: its recurrent mixers"):
        sft._resolve_graphs(SFTConfig(cuda_graphs=True, gated_delta_backend="chunk"), hybrid, None, args)
    dense = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="sdpa")
    assert model_refusal(dense, autocast=True) is None
    assert compile_layers_as_graphs(dense, device="cuda") == dense.config.num_hidden_layers  # compiled lazily


# -- the static collation of sft, on the CPU ---------------------------------------------------------------
def _static_build(tmp_path, *, static, **cfg):
    from varpack.train.sft import build_sft

    kw = dict(
        model="tiny-qwen3",
        output_dir=str(tmp_path / ("static" if static else "dynamic")),
        packing_length=32,
        attn_backend="reference",
        save=False,
        max_steps=3,
        lr=1e-2,
        extra_training_args={"optim": "sgd", "max_grad_norm": 0.0, "use_cpu": True},
    )
    kw.update(cfg)
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    return build_sft(
        SFTConfig(**kw), model=model, tokenizer=_Tok(), encoded=synthetic_samples(), static_shapes=static
    )


def _train(run):
    run.trainer.train()
    losses = [h["loss"] for h in run.trainer.state.log_history if "loss" in h]
    return losses, {n: p.detach().clone() for n, p in run.model.named_parameters()}


def _supervise_pads(collator):
    """Negative control: the pad tokens after the samples get labels (the static path's pads must never be)."""

    def wrapped(features):
        batch = collator(features)
        real = int(batch["varlen_meta"].cu_seqlens_q[len(batch["sample_ids"])])
        labels = batch["labels"].clone()
        labels[0, real:] = batch["input_ids"][0, real:]
        batch["labels"] = labels
        return batch

    return wrapped


@pytest.mark.parametrize("empty_pads", [False, True])
def test_static_shapes_sft_equals_the_dynamic_run(tmp_path, monkeypatch, empty_pads):
    """build_sft(static_shapes=True) pads every pack to StaticShape.from_plan(plan) (every row has its T, N and
    max_seqlen), and 3 optimizer steps give the losses and weights of the dynamic-shape run; supervising the
    pad tokens (control) changes the loss. With EMPTY_PADS_BY_DEFAULT the reference backend gets zero-length
    pad segments (the row is the longest pack itself)."""
    from varpack.integrations import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "EMPTY_PADS_BY_DEFAULT", empty_pads)
    dynamic = _static_build(tmp_path, static=False)
    static = _static_build(tmp_path, static=True)
    shape = static.static_shape
    assert dynamic.static_shape is None and shape is not None
    assert shape.empty_pads == empty_pads and (shape.tokens == 32 if empty_pads else shape.tokens > 32)
    assert shape.segments == int(np.diff(static.plan.offsets).max()) + 1
    assert 0 < static.static_pad < 1
    for batch in static.trainer.get_train_dataloader():
        meta = batch["varlen_meta"]
        assert tuple(batch["input_ids"].shape) == (1, shape.tokens)
        assert meta.num_seqs == shape.segments and meta.max_seqlen_q == shape.max_seqlen
    losses_d, weights_d = _train(dynamic)
    losses_s, weights_s = _train(static)
    assert len(losses_d) == len(losses_s) == 3
    torch.testing.assert_close(losses_s, losses_d, rtol=1e-5, atol=1e-6)
    for name, w in weights_d.items():
        torch.testing.assert_close(weights_s[name], w, rtol=1e-5, atol=1e-6, msg=name)
    control = _static_build(tmp_path / "control", static=True)
    control.trainer.data_collator = _supervise_pads(control.trainer.data_collator)
    losses_c, _ = _train(control)
    assert max(abs(c - d) for c, d in zip(losses_c, losses_d)) > 1e-3  # a step whose pack has pad tokens


def test_trainer_begins_a_graph_step_before_every_forward(tmp_path, monkeypatch):
    """With cuda_graphs the Trainer moves the boundaries to the device, begins a CUDA-graph step before each
    forward and runs every training step inside capture_or_error (wired on the CPU with eager layers; the
    layers' capture is the GPU test's)."""
    from varpack.integrations import cuda_graphs

    calls = []
    monkeypatch.setattr(cuda_graphs, "begin_step", lambda: calls.append("begin"))
    real_move = cuda_graphs.boundaries_on_device

    def move(batch, device):
        calls.append("move")
        return real_move(batch, device)

    monkeypatch.setattr(cuda_graphs, "boundaries_on_device", move)
    entered = []
    real_ctx = cuda_graphs.capture_or_error

    def ctx():
        entered.append(1)
        return real_ctx()

    monkeypatch.setattr(cuda_graphs, "capture_or_error", ctx)
    run = _static_build(tmp_path, static=True)
    run.trainer.cuda_graphs = True
    losses, _ = _train(run)
    assert calls == ["move", "begin"] * 3 and len(entered) == 3
    reference, _ = _train(_static_build(tmp_path / "ref", static=True))
    torch.testing.assert_close(losses, reference, rtol=1e-6, atol=1e-7)


def test_boundaries_on_device_keeps_views():
    from varpack.collate import PaddingFreeCollator
    from varpack.integrations.cuda_graphs import boundaries_on_device

    batch = PaddingFreeCollator()([synthetic_samples(3)])
    moved = boundaries_on_device(dict(batch), "cpu")
    assert moved["varlen_meta"] is batch["varlen_meta"]
    assert moved["cu_seq_lens_q"] is moved["varlen_meta"].cu_seqlens_q
    assert moved["max_length_q"] == batch["varlen_meta"].max_seqlen_q
    assert boundaries_on_device({"input_ids": 1}, "cpu") == {"input_ids": 1}


# -- the speed line ------------------------------------------------------------------------------------------
def test_speed_line_names_the_static_step_and_the_hint():
    from varpack.collate import StaticShape
    from varpack.train.trainer import SpeedReportCallback, describe_speed

    shape = StaticShape(tokens=8320, segments=92, max_seqlen=1672)
    assert shape.describe() == "T=8320 N=92 max_seqlen=1672"
    line = describe_speed(
        CompileChoice(True, "--cuda-graphs"),
        loss_impl="linear_ce",
        loss_why="loss_impl auto",
        static=f"{shape.describe()} (pad 1.6%)",
    )
    assert line == (
        "static shapes T=8320 N=92 max_seqlen=1672 (pad 1.6%), CUDA graphs per layer + chunked linear CE "
        "(--cuda-graphs); the first steps compile and capture every decoder layer"
    )
    auto = CompileChoice(True, GRAPHS_AUTO_REASON, "--cuda-graphs false for dynamic shapes")
    line = describe_speed(
        auto, loss_impl="linear_ce", loss_why="loss_impl auto", static="T=8 N=2 max_seqlen=8 (pad 0.0%)", graphs=auto
    )
    assert line.endswith(f"({GRAPHS_AUTO_REASON}); the first steps compile and capture every decoder layer; "
                         "--cuda-graphs false for dynamic shapes"), line
    on = CompileChoice(
        True, "auto on CUDA: fastest measured, benchmarks/RESULTS.md", "--torch-compile false to skip"
    )
    off = CompileChoice(False, "auto: --grad-accum 4 (grad_accum=4): a step's graph outputs may be overwritten")
    told = describe_speed(on, loss_impl="linear_ce", loss_why="", graphs=off)
    assert told.endswith(f"; --torch-compile false to skip; CUDA graphs off ({off.reason})") and "\n" not in told
    assert "CUDA graphs" not in describe_speed(on, loss_impl="linear_ce", loss_why="")
    lines = []
    trainer = types.SimpleNamespace(model_wrapped=None, planned_loss_impl=lambda m: ("linear_ce", ""))
    cb = SpeedReportCallback(trainer, on, print_fn=lines.append, graphs=off)
    cb.on_train_begin(None, types.SimpleNamespace(is_world_process_zero=True), None)
    assert lines == [f"speed     {told}"]


def test_pad_fraction_of_a_plan():
    from varpack.collate import StaticShape
    from varpack.plan import plan_packs

    plan = plan_packs([10, 20, 5, 7], 32)
    shape = StaticShape.from_plan(plan, multiple_of=8)
    assert shape.pad_fraction(plan) == pytest.approx(1 - 42 / (plan.num_packs * shape.tokens))


# -- GPU ------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("lora", [False, True])
def test_gpu_sft_cuda_graphs_equals_the_default_run(tmp_path, lora):
    """``varpack sft --cuda-graphs``, 3 steps of tiny-qwen3 (head_dim 64, bf16, attention auto) on the built-in
    chats, with and without ``--lora``: the default (auto) takes the graphs; the losses equal the run with
    ``--cuda-graphs false`` within bf16 tolerance, every layer is captured (cudagraph_skips == 0, a skip would also
    raise under capture_or_error), the speed line names the static shape, nothing recompiles after step 1."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run on the GPU machine)")
    from varpack.integrations.cuda_graphs import cudagraph_skips
    from varpack.train import run_sft

    def run(flag):
        lines = []
        config = SFTConfig(
            model="tiny-qwen3",
            output_dir=str(tmp_path / f"{flag}-{lora}"),
            packing_length=1024,
            overflow="truncate",
            max_steps=3,
            dtype="bfloat16",
            save=False,
            cuda_graphs=flag,
            lora=lora,
            lr=1e-2 if lora else None,
        )
        model = load_model(
            "tiny-qwen3", dtype=torch.bfloat16, attn_backend="auto", config_overrides={"head_dim": 64}
        )
        torch._dynamo.reset()
        result = run_sft(config, print_fn=lines.append, model=model)
        return [h["loss"] for h in result.history], lines

    before = cudagraph_skips()
    graphs, lines = run("auto")  # the default takes the graphs on one CUDA GPU
    assert cudagraph_skips() == before
    speed = next(line for line in lines if line.startswith("speed"))
    assert speed.startswith("speed     static shapes T=") and "CUDA graphs per layer" in speed, speed
    assert GRAPHS_AUTO_REASON in speed, speed
    compiled = next(line for line in lines if line.startswith("compile"))
    assert compiled.endswith(", 0 after it"), compiled  # static shapes: nothing recompiles after step 1
    default, lines_d = run(False)
    assert "CUDA graphs off (--cuda-graphs false)" in next(line for line in lines_d if line.startswith("speed"))
    assert len(graphs) == len(default) == 3
    torch.testing.assert_close(graphs, default, rtol=2e-2, atol=2e-2)


def test_auto_asks_the_model_last():
    """``cuda_graphs="auto"`` on one CUDA process is turned off by the model's refusal (reason ``auto: ...``
    naming it): a Gated DeltaNet model, a vision-language model, float32 weights without autocast; a dense
    bf16-autocast model keeps it on. A model not yet loaded is loaded for the question (and returned); a forced
    flag is refused by the same reasons (an error); off or a CPU run never loads the model."""
    from varpack.train import sft

    def args(device="cuda", bf16=True):
        return types.SimpleNamespace(device=torch.device(device), world_size=1, bf16=bf16, fp16=False)

    def never():
        raise AssertionError("loaded")

    dense = load_model("tiny-qwen3", vocab_size=VOCAB)
    choice, model, _ = sft._resolve_graphs(SFTConfig(), dense, never, args())
    assert choice.on and choice.reason == GRAPHS_AUTO_REASON and model is dense
    choice, model, _ = sft._resolve_graphs(SFTConfig(), None, lambda: dense, args())
    assert choice.on and model is dense  # loaded to ask it
    for name, fragment in (("tiny-qwen3.5", "recurrent mixers"), ("tiny-qwen3-vl", "vision-language")):
        choice, _, _ = sft._resolve_graphs(SFTConfig(), load_model(name), never, args())
        assert not choice.on and choice.reason.startswith("auto: ") and fragment in choice.reason, choice
    choice, _, _ = sft._resolve_graphs(SFTConfig(), dense, never, args(bf16=False))
    assert not choice.on and "float32 training" in choice.reason
    assert sft._resolve_graphs(SFTConfig(cuda_graphs=True), dense, never, args())[0].on
    with pytest.raises(ValueError, match="^--cuda-graphs with float32 training"):  # forced: refused, not off
        sft._resolve_graphs(SFTConfig(cuda_graphs=True), dense, never, args(bf16=False))
    assert not sft._resolve_graphs(SFTConfig(), None, never, args(device="cpu"))[0].on
    assert not sft._resolve_graphs(SFTConfig(cuda_graphs=False), None, never, args())[0].on
    # with the plan, the attention a captured layer would resolve to is asked too: here (no FlashAttention-4
    # installed, tiny-qwen3's head dim 16) it is not FA4 / triton_short, so auto falls back, naming it
    from varpack.integrations.cuda_graphs import attention_refusal
    from varpack.plan import plan_packs

    plan = plan_packs([10, 20, 5], 32)
    expected = attention_refusal(dense, backend="auto", device="cuda", dtype=torch.bfloat16, max_seqlen=32)
    choice, _, _ = sft._resolve_graphs(SFTConfig(), dense, never, args(), plan)
    if expected is None:  # a machine where tiny-qwen3's attention is capturable
        assert choice.on
    else:
        assert not choice.on and choice.reason == f"auto: {expected}" and "attention" in expected, choice
        with pytest.raises(ValueError) as forced:  # forced: an error naming the backend, never a failed capture
            sft._resolve_graphs(SFTConfig(cuda_graphs=True), dense, never, args(), plan)
        assert str(forced.value) == f"--cuda-graphs with {expected}"


def test_graph_attention_hands_auto_to_triton_short(monkeypatch):
    """``graph_attention``: ``auto`` resolving outside GRAPH_BACKENDS is handed to triton_short where it runs the
    model's heads at a verified head dim (the reason kept in the note); a backend the user named, a head dim
    outside TRITON_SHORT_GRAPH_HEAD_DIMS, or triton_short refused too keep the refusal; a capturable ``auto``
    stays. Then ``varpack sft``'s choice: graphs on, attention triton_short, the note on the speed line."""
    from varpack.integrations import cuda_graphs
    from varpack.plan import plan_packs
    from varpack.train import sft

    dense = load_model("tiny-qwen3", vocab_size=VOCAB, config_overrides={"head_dim": 64})
    small = load_model("tiny-qwen3", vocab_size=VOCAB)  # head dim 16
    why = "attention 'auto' resolves to sdpa here (head dim 64, bfloat16): captured layers need flash_attn_4 or triton_short"
    answers = {"auto": why, "triton_short": None, "flex": "attention 'flex' resolves to flex here"}
    asked = []

    def refusal(model, *, backend, **k):
        asked.append(backend)
        return answers[backend]

    monkeypatch.setattr(cuda_graphs, "attention_refusal", refusal)
    kw = dict(device="cuda", dtype=torch.bfloat16, max_seqlen=300)
    note = f"attention triton_short in the captured layers ({why})"
    assert cuda_graphs.graph_attention(dense, backend="auto", **kw) == ("triton_short", None, note)
    assert asked == ["auto", "triton_short"]
    assert cuda_graphs.graph_attention(dense, backend="flex", **kw) == ("flex", answers["flex"], None)
    assert cuda_graphs.graph_attention(small, backend="auto", **kw) == ("auto", why, None)
    answers["triton_short"] = "attention 'triton_short': not on this GPU"
    assert cuda_graphs.graph_attention(dense, backend="auto", **kw) == ("auto", why, None)
    answers["auto"] = None
    assert cuda_graphs.graph_attention(dense, backend="auto", **kw) == ("auto", None, None)

    answers.update(auto=why, triton_short=None)
    args = types.SimpleNamespace(device=torch.device("cuda"), world_size=1, bf16=True, fp16=False)
    plan = plan_packs([10, 20, 5], 32)
    choice, model, attn = sft._resolve_graphs(SFTConfig(), dense, None, args, plan)
    assert choice.on and choice.reason == f"{GRAPHS_AUTO_REASON}; {note}" and attn == "triton_short"
    choice, _, attn = sft._resolve_graphs(SFTConfig(), small, None, args, plan)
    assert not choice.on and choice.reason == f"auto: {why}" and attn == "auto"
    choice, _, attn = sft._resolve_graphs(SFTConfig(cuda_graphs=True), dense, None, args, plan)
    assert choice.on and attn == "triton_short"
    answers["triton_short"] = "attention 'triton_short': not on this GPU"  # a named backend is never replaced
    with pytest.raises(ValueError, match=r"^--cuda-graphs with attention 'triton_short': not on this GPU$"):
        sft._resolve_graphs(SFTConfig(cuda_graphs=True, attn_backend="triton_short"), dense, None, args, plan)


def test_prepare_model_takes_the_runs_attention_backend():
    """The backend ``_resolve_graphs`` chose in place of the config's reaches the model, loaded before or in
    ``_prepare_model``; without one the config's backend stays (negative control)."""
    from varpack.train.sft import _prepare_model

    config = SFTConfig(torch_compile=False, cuda_graphs=False)  # config.attn_backend: auto
    model = load_model("tiny-qwen3", vocab_size=VOCAB)
    assert _prepare_model(config, model, lambda: None).config._attn_implementation == "varpack"
    out = _prepare_model(config, model, lambda: None, attn_backend="triton_short")
    assert out.config._attn_implementation == "varpack_triton_short" and out._varpack_state.backend == "triton_short"
    loaded = _prepare_model(config, None, lambda: load_model("tiny-qwen3", vocab_size=VOCAB), attn_backend="triton_short")
    assert loaded.config._attn_implementation == "varpack_triton_short"
    assert config.attn_backend == "auto"


@pytest.mark.parametrize("backend", ["auto", "flash_attn_4", "triton_short"])
def test_capturable_attention_backends_pass_the_check(backend):
    check_cuda_graphs(
        SFTConfig(cuda_graphs=True, attn_backend=backend), device="cuda", world_size=1, environ={}
    )
