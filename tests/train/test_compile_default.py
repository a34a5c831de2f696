"""`torch_compile="auto"`: on CUDA `varpack sft` compiles its decoder layers by default
unless a setting conflicts or is untested with it, off on a CPU; the run says which on its `speed` line, and
the saved varpack_config.yaml holds the resolved value. (Packed == unpacked of compiled layers:
tests/invariant/test_compile_and_liger.py.)"""

from __future__ import annotations

import argparse
import dataclasses
import types

import pytest
import torch

from varpack._argtypes import parse_auto_bool
from varpack.cli.main import build_parser, main
from varpack.train.cli_flags import config_from_args, config_to_argv
from varpack.train.config import COMPILE_COLD_COST, CompileChoice, SFTConfig, resolve_torch_compile
from varpack.train.config_file import load_config_file, write_config_file

ON_CUDA = "auto on CUDA: fastest measured, benchmarks/RESULTS.md"


def _parse(*argv: str) -> SFTConfig:
    return config_from_args(build_parser().parse_args(["sft", *argv]))


# ------------------------------------------------------------------------------------------------------
# the resolution
# ------------------------------------------------------------------------------------------------------
def test_auto_compiles_on_cuda_only():
    auto = SFTConfig()
    assert auto.torch_compile == "auto"
    assert resolve_torch_compile(auto, device="cuda") == CompileChoice(
        True, ON_CUDA, "--torch-compile false to skip"
    )
    for device in ("cpu", "mps", "xpu"):
        choice = resolve_torch_compile(auto, device=device)
        assert choice == CompileChoice(False, f"auto: {device.upper()} run; compiled by default on CUDA only")


def test_explicit_values_are_kept_on_every_device():
    for device in ("cuda", "cpu"):
        assert resolve_torch_compile(SFTConfig(torch_compile=True), device=device) == (
            True,
            "--torch-compile",
            "",
        )
        off = resolve_torch_compile(SFTConfig(torch_compile=False), device=device, world_size=4)
        assert off == (False, "--torch-compile false", "")
    # explicit True is the user's choice even where auto stays off (Liger + True is refused by build_sft)
    assert resolve_torch_compile(SFTConfig(torch_compile=True, lora=True), device="cuda", world_size=2).on


#: one setting that keeps "auto" eager on CUDA -> (config fields, world_size, environment, reason fragment)
CONFLICTS = {
    "liger": (dict(use_liger_kernel=True), 1, {}, "--use-liger-kernel"),
    "context_parallel": (dict(context_parallel=2), 2, {}, "--context-parallel"),
    # FSDP1: compiled layers are tested inside FSDP2 units only (tests/train/test_ddp_compile_gloo.py)
    "fsdp1_extra": (
        dict(extra_training_args={"fsdp": True, "fsdp_config": {"version": 1}}), 2, {}, "FSDP version 1"
    ),
    "fsdp1_prefixed": (
        dict(fsdp=True, extra_training_args={"fsdp_config": {"fsdp_version": 1}}), 2, {}, "FSDP version 1"
    ),
    "fsdp_config_file": (
        dict(extra_training_args={"fsdp": True, "fsdp_config": "fsdp.json"}), 2, {}, "fsdp_config file (not read)"
    ),
    "fsdp1_accelerate": (dict(), 2, {"ACCELERATE_USE_FSDP": "true"}, "FSDP version 1"),  # accelerate's default
    "deepspeed_extra": (dict(extra_training_args={"deepspeed": "ds.json"}), 1, {}, "DeepSpeed"),
    "deepspeed_accelerate": (dict(), 1, {"ACCELERATE_USE_DEEPSPEED": "1"}, "DeepSpeed"),
    "lora": (dict(lora=True), 1, {}, "--lora"),
    "hf_compile": (
        dict(extra_training_args={"torch_compile": True}),
        1,
        {},
        "transformers' own torch_compile",
    ),
    # TrainingArguments turns torch_compile on for a backend or a mode
    "hf_compile_backend": (
        dict(extra_training_args={"torch_compile_backend": "inductor"}), 1, {}, "transformers' own torch_compile"
    ),
    "hf_compile_mode": (
        dict(extra_training_args={"torch_compile_mode": "default"}), 1, {}, "transformers' own torch_compile"
    ),
}


@pytest.mark.parametrize("name", sorted(CONFLICTS))
def test_each_conflict_keeps_auto_eager_on_cuda(name):
    fields, world, env, fragment = CONFLICTS[name]
    choice = resolve_torch_compile(SFTConfig(**fields), device="cuda", world_size=world, environ=env)
    assert not choice.on and choice.reason.startswith("auto: ") and fragment in choice.reason, choice
    # Liger / context parallelism refuse compile, so no flag is offered to force it; the others name it
    assert choice.hint == ("" if name in ("liger", "context_parallel") else "--torch-compile to compile anyway")
    # control: without that setting the same run compiles
    assert resolve_torch_compile(SFTConfig(), device="cuda", world_size=1, environ={}).on


#: several ranks that compile under auto on CUDA -> (config fields, world_size, environment, engine named)
MULTI_RANK = {
    "ddp": (dict(), 2, {}, "DDP"),
    "fsdp": (dict(fsdp=True), 2, {}, "FSDP2"),
    "fsdp_extra": (dict(extra_training_args={"fsdp": "full_shard"}), 2, {}, "FSDP2"),  # transformers' default: 2
    "fsdp2_extra": (dict(extra_training_args={"fsdp": True, "fsdp_config": {"version": 2}}), 4, {}, "FSDP2"),
    "fsdp2_accelerate": (dict(), 2, {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, "FSDP2"),
}


@pytest.mark.parametrize("name", sorted(MULTI_RANK))
def test_auto_compiles_under_ddp_and_fsdp2_on_cuda(name):
    """Compiled layers under DDP and FSDP2 equal the one-process step (tests/train/test_ddp_compile_gloo.py),
    so auto compiles there; the reason names the engine, and that the speed-up is measured on one GPU."""
    fields, world, env, engine = MULTI_RANK[name]
    choice = resolve_torch_compile(SFTConfig(**fields), device="cuda", world_size=world, environ=env)
    assert choice == CompileChoice(
        True, f"auto on CUDA: fastest measured on one GPU, exact under {engine}", "--torch-compile false to skip"
    )
    # control: LoRA on the same ranks stays eager
    lora = resolve_torch_compile(SFTConfig(lora=True, **fields), device="cuda", world_size=world, environ=env)
    assert not lora.on and "--lora" in lora.reason


@pytest.mark.parametrize(
    "fields",
    [
        dict(
            gradient_checkpointing=True
        ),  # compiled + recomputed layers are exact (test_compile_and_liger.py)
        dict(objective="dpo"),
        dict(streaming=True, max_steps=3),
        dict(bf16=True, loss_impl="logits"),
        dict(extra_training_args={"fsdp": "", "deepspeed": None, "torch_compile": False}),  # set but off
    ],
)
def test_settings_that_do_not_conflict(fields):
    assert resolve_torch_compile(
        SFTConfig(**fields), device="cuda", environ={"ACCELERATE_USE_FSDP": "false"}
    ).on


def test_config_refuses_other_values():
    for bad in (1, 0, None):
        with pytest.raises(
            ValueError, match=r"SFTConfig\.torch_compile has an invalid value: .*True, False or 'auto'"
        ):
            SFTConfig(torch_compile=bad)
    for bad in ("on", "sometimes"):  # text the flag refuses too
        with pytest.raises(ValueError, match=r"SFTConfig\.torch_compile .*\(must be auto, true or false"):
            SFTConfig(torch_compile=bad)


# ------------------------------------------------------------------------------------------------------
# flags and files
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "value"),
    [
        ((), "auto"),
        (("--torch-compile",), True),
        (("--torch-compile", "--max-steps", "3"), True),  # no value: on, the next flag is not eaten
        (("--torch-compile", "true"), True),
        (("--torch_compile", "True"), True),  # HF / TRL spelling
        (("--torch-compile", "false"), False),
        (("--torch-compile", "0"), False),
        (("--no-torch-compile",), False),
        (("--no_torch_compile",), False),
        (("--torch-compile", "auto"), "auto"),
        (("--torch-compile", "--torch-compile", "AUTO"), "auto"),  # the last one wins
        (("--no-torch-compile", "--torch-compile"), True),
    ],
)
def test_flag_parses_on_off_and_auto(argv, value):
    assert _parse(*argv).torch_compile == value
    assert _parse(*argv).max_steps == (3 if "--max-steps" in argv else -1)


def test_bad_flag_value_is_a_usage_error(capsys):
    assert main(["sft", "--torch-compile", "maybe", "--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--torch-compile" in err and "must be auto, true or false, got 'maybe'" in err
    with pytest.raises(argparse.ArgumentTypeError):
        parse_auto_bool("sometimes")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("false", False), ("False", False), ("0", False), ("no", False),
        ("true", True), ("YES", True), ("auto", "auto"),
    ],  # fmt: skip
)
def test_config_flag_and_file_read_the_same_spellings(tmp_path, text, value):
    """One parser (varpack._argtypes.parse_auto_bool) for SFTConfig, the flag and a --config file: a switch
    written as text means the same wherever it is written."""
    assert SFTConfig(torch_compile=text).torch_compile == value
    assert _parse("--torch-compile", text).torch_compile == value
    path = tmp_path / "run.yaml"
    path.write_text(f"torch_compile: '{text}'\n")  # quoted: a string, as a YAML writer may leave it
    assert load_config_file(path).torch_compile == value


def test_switch_given_as_text_is_read_or_refused():
    """A bool field given as text is read by the same parser (a non-empty string would be truthy: "false"
    switched it on); anything else but a bool is refused, naming the field."""
    assert SFTConfig(lora="false").lora is False and SFTConfig(lora="1").lora is True
    for name, bad, rule in (
        ("torch_compile", "maybe", "must be auto, true or false, got 'maybe'"),
        ("lora", "off-ish", "must be true or false, got 'off-ish'"),
        ("torch_compile", 1, "must be True, False or 'auto'"),
        ("bf16", None, "must be True or False"),
    ):
        with pytest.raises(ValueError, match=rf"SFTConfig\.{name} has an invalid value: {bad!r} \({rule}"):
            SFTConfig(**{name: bad})


@pytest.mark.parametrize("value", [True, False, "auto"])
def test_flags_and_yaml_round_trip(tmp_path, value):
    config = SFTConfig(torch_compile=value, seed=5)
    argv = config_to_argv(config)
    assert _parse(*argv) == config
    path = write_config_file(config, tmp_path / "run.yaml")
    assert load_config_file(path) == config == _parse("--config", str(path))
    # a flag given on the command line overrides the file
    assert _parse("--config", str(path), "--no-torch-compile").torch_compile is False


def test_help_names_every_auto_rule():
    """--torch-compile's help names each case resolve_torch_compile keeps eager under auto (it left out
    transformers' own torch_compile and said "off on a CPU" for every non-CUDA device)."""
    sft = build_parser()._subparsers._group_actions[0].choices["sft"]
    text = " ".join(next(a.help for a in sft._actions if a.dest == "torch_compile").split())
    for rule in (
        "CUDA run (one process, DDP or FSDP2)",
        "--use-liger-kernel",
        "--lora",
        "--context-parallel",
        "FSDP1",
        "DeepSpeed",
        "--extra-training-args",
    ):
        assert rule in text, (rule, text)
    assert "any other device" in text, text


def test_yaml_values(tmp_path, capsys):
    for text, value in (
        ("auto", "auto"),
        ("true", True),
        ("false", False),
        ("'auto'", "auto"),
        ('"true"', True),  # quoted, as --torch-compile true reads it (was refused: "must be true, ...")
        ("'False'", False),
        ("'AUTO'", "auto"),
    ):
        path = tmp_path / "run.yaml"
        path.write_text(f"torch_compile: {text}\n")
        assert _parse("--config", str(path)).torch_compile == value, text
    for text, rule in (
        ("maybe", "auto, true or false, got 'maybe'"),  # the flag's own parser and words
        ("1", "auto, true or false, got 1"),
        ("'maybe'", "got 'maybe'"),
        ("null", "not be null"),
    ):
        path.write_text(f"torch-compile: {text}\n")
        assert main(["sft", "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert "SFTConfig.torch_compile has an invalid value" in err and rule in err, err


# ------------------------------------------------------------------------------------------------------
# the run: resolved config, compiled layers, the speed line
# ------------------------------------------------------------------------------------------------------
def test_explicit_flag_on_cpu_still_compiles_and_auto_does_not(tmp_path):
    """--torch-compile on a CPU compiles every decoder layer as before; the default (auto) leaves them eager
    and the returned config records the resolved value."""
    from tests.train.test_cli_sft import _build
    from varpack.integrations.kernels import decoder_layers

    given = _parse("--torch-compile")
    run = _build(tmp_path / "on", torch_compile=given.torch_compile)
    assert run.config.torch_compile is True and run.compile_choice == (True, "--torch-compile", "")
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(run.model))
    auto = _build(tmp_path / "auto")
    assert auto.config.torch_compile is False
    assert auto.compile_choice == (False, "auto: CPU run; compiled by default on CUDA only", "")
    assert all(layer._compiled_call_impl is None for layer in decoder_layers(auto.model))


def test_prepare_model_refuses_an_unresolved_auto():
    from varpack.train.sft import _prepare_model

    with pytest.raises(ValueError, match="resolved"):
        _prepare_model(SFTConfig(), object(), lambda: None)


def test_describe_speed():
    from varpack.train.trainer import describe_speed

    on = CompileChoice(True, ON_CUDA, "--torch-compile false to skip")
    assert describe_speed(on, loss_impl="linear_ce", loss_why="loss_impl auto") == (
        f"regional torch.compile + chunked linear CE ({ON_CUDA}); {COMPILE_COLD_COST}; --torch-compile false to skip"
    )
    cpu = CompileChoice(False, "auto: CPU run; compiled by default on CUDA only")
    assert describe_speed(cpu, loss_impl="logits", loss_why="--loss-impl logits") == (
        "eager + CE on the logits (auto: CPU run; compiled by default on CUDA only; loss forced by --loss-impl "
        "logits)"
    )
    # a forced linear CE is named too (it read as auto's choice: "eager + chunked linear CE (auto: CPU run; ...)")
    assert describe_speed(cpu, loss_impl="linear_ce", loss_why="--loss-impl linear_ce") == (
        "eager + chunked linear CE (auto: CPU run; compiled by default on CUDA only; loss forced by --loss-impl "
        "linear_ce)"
    )
    # auto's own choice of the logits keeps its reason
    assert describe_speed(cpu, loss_impl="logits", loss_why="loss_impl auto: the model is wrapped (DDP)") == (
        "eager + CE on the logits (auto: CPU run; compiled by default on CUDA only; logits: loss_impl auto: the "
        "model is wrapped (DDP))"
    )
    liger = CompileChoice(False, "auto: --use-liger-kernel, which is not combined with compile")
    assert describe_speed(liger, loss_impl="linear_ce", loss_why="", liger=True).startswith(
        "Liger-Kernel layers + chunked linear CE (auto: --use-liger-kernel"
    )
    # transformers' own torch_compile (--extra-training-args) compiles the whole model: never called "eager"
    hf = CompileChoice(
        False, "auto: transformers' own torch_compile (extra_training_args) compiles the whole model"
    )
    hf_why = "loss_impl auto: transformers' own torch_compile compiles the model's forward"
    line = describe_speed(hf, loss_impl="logits", loss_why=hf_why, hf_compile=True)
    assert line.startswith(
        "transformers' whole-model torch.compile + CE on the logits (auto: transformers'"
    ), line
    assert line.endswith(f"logits: {hf_why})"), line
    both = describe_speed(
        CompileChoice(True, "--torch-compile"), loss_impl="logits", loss_why=hf_why, hf_compile=True
    )
    assert both.startswith(
        "regional torch.compile inside transformers' whole-model torch.compile + CE on the logits"
    ), both
    assert "eager" not in line + both


def test_speed_line_names_transformers_compile(tmp_path):
    """The speed line of a run given transformers' torch_compile in --extra-training-args says so (seen: the
    line read "eager + chunked linear CE (auto: CPU run; ...)" while Trainer compiled the whole model)."""
    from varpack.train.trainer import SpeedReportCallback

    class Trainer:
        model_wrapped = None

        def planned_loss_impl(self, model):
            return "logits", "loss_impl auto: transformers' own torch_compile compiles the model's forward"

    lines = []
    choice = CompileChoice(False, "auto: CPU run; compiled by default on CUDA only")
    callback = SpeedReportCallback(Trainer(), choice, print_fn=lines.append)
    state = types.SimpleNamespace(is_world_process_zero=True)
    callback.on_train_begin(types.SimpleNamespace(torch_compile=True), state, None)
    callback.on_train_begin(types.SimpleNamespace(torch_compile=False), state, None)  # control
    assert lines[0].startswith("speed     transformers' whole-model torch.compile + CE on the logits"), lines
    assert lines[1].startswith("speed     eager + CE on the logits"), lines


def test_transformers_compile_takes_the_logits_path():
    """transformers' own ``torch_compile`` compiles the model's forward; the linear CE calls the base model and
    the head outside it, so the compile would never run: auto takes the logits (the compiled forward), a
    forced linear CE is refused by name; without it, auto keeps the linear CE (control)."""
    from varpack.train.trainer import PackedLossMixin

    model = torch.nn.Linear(2, 2)

    def trainer(loss_impl, torch_compile):
        return types.SimpleNamespace(
            loss_impl=loss_impl,
            args=types.SimpleNamespace(torch_compile=torch_compile),
            accelerator=types.SimpleNamespace(unwrap_model=lambda m: m),
        )

    use, why = PackedLossMixin._linear_ce_choice(trainer("auto", True), model)
    assert not use and why == "loss_impl auto: transformers' own torch_compile compiles the model's forward"
    with pytest.raises(ValueError, match="loss_impl='linear_ce' .*TrainingArguments.torch_compile compiles"):
        PackedLossMixin._linear_ce_choice(trainer("linear_ce", True), model)
    assert PackedLossMixin._linear_ce_choice(trainer("linear_ce", False), model) == (True, "--loss-impl linear_ce")
    # refused before the run starts, for any setting that turns transformers' compile on
    for extra in ({"torch_compile": True}, {"torch_compile_backend": "inductor"}, {"torch_compile_mode": "default"}):
        with pytest.raises(ValueError, match=r"loss_impl='linear_ce' .*TrainingArguments\.torch_compile"):
            SFTConfig(loss_impl="linear_ce", extra_training_args=extra)
        assert SFTConfig(loss_impl="logits", extra_training_args=extra)  # control


def test_planned_loss_impl_follows_the_objective():
    from varpack.train.trainer import PackedLossMixin

    class Stub(PackedLossMixin):
        def __init__(self, objective):
            self.objective = objective

        def _linear_ce_choice(self, model):
            return True, "loss_impl auto"

    class Dpo:
        name = "dpo"
        supports_linear_ce = False

    class Sft:
        name = "sft"

    assert Stub(Sft()).planned_loss_impl(None) == ("linear_ce", "loss_impl auto")
    assert Stub(Dpo()).planned_loss_impl(None) == ("logits", "the dpo objective reads the logits")
    from varpack.train.objectives.dpo import DPOObjective

    assert DPOObjective.supports_linear_ce is False


def test_speed_note_when_the_loss_ran_otherwise():
    """The speed line's loss is the planned one; if the first step ran another, a note says so."""
    from types import SimpleNamespace

    from varpack.train.trainer import SpeedReportCallback

    lines: list[str] = []
    trainer = SimpleNamespace(
        model_wrapped=None, planned_loss_impl=lambda m: ("linear_ce", "loss_impl auto"), loss_impl_used=None
    )
    cb = SpeedReportCallback(trainer, CompileChoice(False, "--torch-compile false"), print_fn=lines.append)
    state = SimpleNamespace(is_world_process_zero=True)
    cb.on_train_begin(None, state, None)
    assert lines == ["speed     eager + chunked linear CE (--torch-compile false)"]
    trainer.loss_impl_used = "linear_ce"
    cb.on_step_end(None, state, None)
    assert len(lines) == 1  # as reported: nothing more
    cb.on_train_begin(None, state, None)
    trainer.loss_impl_used = "logits"
    cb.on_step_end(None, state, None)
    cb.on_step_end(None, state, None)  # checked once
    assert lines[2:] == ["speed     note: the loss ran as logits, not linear_ce as reported above"]


@pytest.mark.parametrize("loss_impl", ["auto", "logits", "linear_ce"])
def test_run_prints_the_speed_line_it_ran(tmp_path, loss_impl):
    """A 1-step CPU run: the speed line names the loss implementation the step then ran, and a forced one as
    forced."""
    from tests.train.test_cli_sft import VOCAB, one_step_cpu_run
    from varpack.models import load_model

    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    run, config, lines = one_step_cpu_run(tmp_path, model, loss_impl=loss_impl)
    speed = [line for line in lines if line.startswith("speed")]
    used = run.trainer.loss_impl_used
    assert used == ("linear_ce" if loss_impl == "auto" else loss_impl)
    cpu = "auto: CPU run; compiled by default on CUDA only"
    expected = {  # a forced implementation says so (it read as auto's choice: a fresh user's review)
        "auto": f"chunked linear CE ({cpu})",
        "linear_ce": f"chunked linear CE ({cpu}; loss forced by --loss-impl linear_ce)",
        "logits": f"CE on the logits ({cpu}; loss forced by --loss-impl logits)",
    }[loss_impl]
    assert speed == [f"speed     eager + {expected}; CUDA graphs off (auto: CPU run; CUDA graphs need a CUDA GPU)"]
    engine = next(i for i, line in enumerate(lines) if line.startswith("engine"))
    assert lines[engine + 1] == speed[0]  # next to the engine line
    assert dataclasses.replace(run.config, lr=None, torch_compile="auto", cuda_graphs="auto") == config


def test_report_lines_go_above_the_progress_bar(monkeypatch):
    """The engine / speed lines are printed while the Trainer's tqdm bar is drawn: with the built-in print they
    go through tqdm.write (they were glued to the bar's end: '0%| | 0/2 [...]engine    single process'); a
    caller's own print_fn is kept as given."""
    import tqdm.auto

    from varpack.train.trainer import EngineReportCallback, _bar_safe

    written = []
    monkeypatch.setattr(tqdm.auto.tqdm, "write", classmethod(lambda cls, s, *a, **k: written.append(s)))
    EngineReportCallback().print_fn("engine    single process")
    assert written == ["engine    single process"]
    lines = []

    def own(line):
        lines.append(line)

    assert _bar_safe(own) is own


def test_compile_count_line(monkeypatch):
    """The ``compile`` line counts the graphs compiled in step 1 and after it, from dynamo's counter between
    steps (a step that recompiles is named); a steady run says 0 after it."""
    from varpack.train import trainer as trainer_mod

    graphs = iter([5, 7, 7, 7, 9, 9])  # train begin, then the end of steps 1..5
    monkeypatch.setattr(trainer_mod, "compiled_graphs", lambda: next(graphs))
    lines = []
    cb = trainer_mod.CompileCountCallback(print_fn=lines.append)
    state = types.SimpleNamespace(global_step=0, is_world_process_zero=True)
    cb.on_train_begin(None, state, None)
    for step in range(1, 6):
        state.global_step = step
        cb.on_step_end(None, state, None)
    cb.on_train_end(None, state, None)
    assert lines == ["compile   2 graphs compiled in step 1, 2 after it (last in step 4)"]
    assert (cb.first, cb.after_first, cb.last_step) == (2, 2, 4)
    steady = iter([0, 3, 3])
    monkeypatch.setattr(trainer_mod, "compiled_graphs", lambda: next(steady))
    cb.on_train_begin(None, state, None)
    for step in (1, 2):
        state.global_step = step
        cb.on_step_end(None, state, None)
    cb.on_train_end(None, state, None)
    assert lines[-1] == "compile   3 graphs compiled in step 1, 0 after it"


def test_compiled_graphs_counts_dynamo_graphs():
    """:func:`compiled_graphs` reads dynamo's counter: one more after compiling a new function, none after a
    second call with the same shapes (aot_eager: no code generation)."""
    from varpack.train.trainer import compiled_graphs

    fn = torch.compile(lambda x: x * 2 + 1, backend="aot_eager", dynamic=False)
    before = compiled_graphs()
    fn(torch.ones(3))
    once = compiled_graphs()
    fn(torch.ones(3))
    assert once == before + 1 and compiled_graphs() == once


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-qwen3"])
def test_compiled_run_keeps_mixers_as_graph_breaks(monkeypatch, name):
    """A compiled run compiles its layers with attention and Gated DeltaNet mixers as graph breaks
    (``compile_layers(model)``, no custom ops): the mixers traced whole through the custom ops measured 2.5x
    slower on an H200 (benchmarks/RESULTS.md#hybrid-step), so they are not the default."""
    from varpack.integrations import kernels
    from varpack.models import load_model
    from varpack.train.sft import _prepare_model

    seen = []
    monkeypatch.setattr(kernels, "compile_layers", lambda model, **kw: seen.append(kw) or 1)
    config = SFTConfig(model=name, torch_compile=True, cuda_graphs=False)
    _prepare_model(config, load_model(name), lambda: None)
    assert seen == [{}], seen


def test_compile_count_names_the_failed_guard():
    """A recompilation after step 1 is named on the ``compile`` output by the guard that failed (dynamo's
    ``recompile_reason``); step 1's own compilations are not listed. Negative control: a static-shape function
    called with a new size recompiles, so a reason must appear."""
    from varpack.train.trainer import CompileCountCallback

    fn = torch.compile(lambda x: x * 3 - 1, backend="aot_eager", dynamic=False)
    lines = []
    cb = CompileCountCallback(print_fn=lines.append)
    state = types.SimpleNamespace(global_step=0, is_world_process_zero=True)
    cb.on_train_begin(None, state, None)
    for step, size in ((1, 5), (2, 5), (3, 6)):  # step 3: a new size for a graph specialised to 5
        state.global_step = step
        fn(torch.ones(size))
        cb.on_step_end(None, state, None)
    cb.on_train_end(None, state, None)
    assert (cb.first, cb.after_first, cb.last_step) == (1, 1, 3)
    assert len(cb.reasons) == 1 and cb.reasons[0][0] == 3, cb.reasons
    assert "size mismatch at index 0" in cb.reasons[0][1] and "expected 5, actual 6" in cb.reasons[0][1]
    assert lines[0] == "compile   1 graph compiled in step 1, 1 after it (last in step 3)"
    assert lines[1].startswith("compile   recompiled (step 3): ") and "size mismatch" in lines[1]
