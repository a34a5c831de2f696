"""Compiled decoder layers (``torch_compile``: regional compile, one ``torch.compile`` per decoder layer, varpack
attention a graph break) under several ranks, 2 CPU ranks over gloo: the DDP step of ``varpack sft`` and the
FSDP2 step (``fully_shard`` per compiled decoder layer and the root) each equal the one-process eager step over
the same packs (global token mean): the loss, and every parameter's update (the SGD step at lr 1, so the update
is minus the gradient), per tensor relative to its own scale (:mod:`tests._exact`). The negative control, the
loss divided by each rank's own token count (per-rank means averaged over the ranks), is caught by the same
rule. Each rank counts the calls that went through the compiled layers, so an eager run cannot pass, and
checks that the second micro-batch (another pack shape) reused the first one's graphs.

Measured (``VARPACK_TEST_GAPS=1 pytest -s``; torch 2.13.0+cpu): DDP's update 0.006 x the bound, FSDP2's 0.28 x
(a layer norm's gradient, 5.8e-8 of 1.1e-3; the eager FSDP2 step of tests/train/test_ddp_gloo.py differs from
the one-process step by the same 0.28 x, and compiled from eager FSDP2 by 0.002 x: the gap is FSDP2's
reduce-scatter order, not compile); the controls 4.5e3 x (DDP) and 1.7e4 x (FSDP2).

Backend: ``aot_eager`` (dynamo + AOTAutograd, the graphs inductor would receive, without code generation),
installed by :func:`use_aot_eager` in the rank processes only. Inductor's C++ build on a CPU took 53 s for one
process's first step of tiny-qwen3 with an empty cache (2-core machine; torch 2.13), two ranks building at once
and three runs per rank would take this test past minutes; inductor's numerics for compiled layers are checked
in one process by tests/invariant/test_compile_and_liger.py (``backend`` ``inductor``)."""

from __future__ import annotations

from tests import _exact
from tests import _launch as launch

#: decoder layers of tiny-qwen3
LAYERS = 2


def use_aot_eager(calls: list) -> None:
    """Test-only hook: :func:`varpack.integrations.kernels.compile_layers` (which ``build_sft`` looks up at the
    time it prepares the model) compiles with ``backend="aot_eager"`` instead of inductor, and appends
    ``(layer index, graphs dynamo has captured so far)`` to ``calls`` each time a compiled layer is called
    (``nn.Module.__call__`` goes through ``_compiled_call_impl`` when it is set)."""
    from torch._dynamo.utils import counters

    from varpack.integrations import kernels

    original = kernels.compile_layers

    def compile_layers(model, *, backend="aot_eager", **kw):
        n = original(model, backend="aot_eager", **kw)
        for i, layer in enumerate(kernels.decoder_layers(model)):
            impl = layer._compiled_call_impl

            def counted(*args, _impl=impl, _i=i, **kwargs):
                out = _impl(*args, **kwargs)
                calls.append((_i, counters["stats"]["unique_graphs"]))
                return out

            layer._compiled_call_impl = counted
        return n

    kernels.compile_layers = compile_layers


_SCRIPT = r"""
import json, os, pathlib, sys, torch
sys.path.insert(0, {root!r})
from torch._dynamo.utils import counters
from tests.train.test_ddp_compile_gloo import use_aot_eager
from tests.train.test_ddp_gloo import fsdp2_step, one_step
out = pathlib.Path({out!r})
rank = int(os.environ["RANK"])
calls = []
use_aot_eager(calls)
result = {{}}
for name, extra in [("ddp", {{}}), ("ddp-control", {{"average_tokens_across_devices": False}})]:
    before = len(calls)
    run, delta, loss = one_step(out / name, torch_compile=True, grad_accum=2, extra=extra)
    if rank == 0:
        torch.save(delta, out / f"{{name}}.pt")
    result[name] = {{
        "loss": loss, "ids": run.trained_ids, "engine": run.engines, "speed": run.speed,
        "calls": calls[before:], "micro_batches": 2,
    }}
for name, global_items in [("fsdp", True), ("fsdp-control", False)]:
    before = len(calls)
    grads, loss = fsdp2_step("token", global_items=global_items, compile_backend="aot_eager")
    if rank == 0:
        torch.save({{n: -g for n, g in grads.items()}}, out / f"{{name}}.pt")  # the SGD step at lr 1
    result[name] = {{
        "loss": loss, "calls": calls[before:], "micro_batches": 2
    }}
(out / f"result{{rank}}.json").write_text(json.dumps(result))
from varpack.train.distributed import close_process_group
close_process_group()
"""


def test_compiled_layers_under_ddp_and_fsdp2_equal_the_one_process_step(tmp_path):
    from tests.train.test_ddp_gloo import LENGTHS, one_step

    results = launch.run_ranks(_SCRIPT, tmp_path)

    for r in range(2):
        # the compiled layers ran: every decoder layer, once per micro-batch, on every rank, in every run
        for name in ("ddp", "ddp-control", "fsdp", "fsdp-control"):
            got = results[r][name]
            layers, graphs = zip(*got["calls"])
            assert sorted(layers) == sorted(list(range(LAYERS)) * got["micro_batches"]), (r, name)
            # dynamo captured graphs, and the second micro-batch (another pack shape) reused them
            assert graphs[-1] == graphs[LAYERS - 1] > 0, (r, name, graphs)
        # the step is the whole epoch: each sample trained by exactly one rank, once
        for name in ("ddp", "ddp-control"):
            ids = results[0][name]["ids"] + results[1][name]["ids"]
            assert sorted(ids) == list(range(len(LENGTHS)))
    # what varpack sft prints (main process only): DDP, and the compiled layers it runs
    assert results[0]["ddp"]["engine"] == ["engine    DDP on 2 ranks"] and results[1]["ddp"]["engine"] == []
    (speed,) = results[0]["ddp"]["speed"]
    assert speed.startswith("speed     regional torch.compile") and "(--torch-compile" in speed, speed
    assert results[1]["ddp"]["speed"] == []

    # the one-process eager step over the same 3 packs in one row (the reference)
    _, ref, ref_loss = one_step(tmp_path / "ref", packs_per_step=3)
    import torch

    for engine in ("ddp", "fsdp"):
        got = torch.load(tmp_path / f"{engine}.pt")
        _exact.assert_exact(got, ref, what=f"{engine} update")
        for r in range(2):
            _exact.assert_exact(results[r][engine]["loss"], ref_loss, rtol=_exact.LOSS_RTOL, what="loss")
        # negative control: each rank's own token mean, averaged over the ranks
        wrong = torch.load(tmp_path / f"{engine}-control.pt")
        _exact.assert_differs(wrong, ref, what=f"{engine}-control update")
        # and the loss rule catches its loss (measured 64 x the bound: 6.2012 vs 6.2032)
        off = _exact.measure(results[0][f"{engine}-control"]["loss"], ref_loss, rtol=_exact.LOSS_RTOL, what="loss")
        assert off.ratio > 10, off
