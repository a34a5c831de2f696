"""benchmarks/profile_sft.py: a host call's source named from its own Python frames or, for a CUDA runtime call the
profiler links to none, from the frame open at its start (negative control: a call outside every frame stays
unnamed); the CPU smoke run of `varpack sft` under the profile window, with its argument checks."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest

from benchmarks.profile_sft import HostSampler, SyncSites, _Frames, main


def _evt(name, start, end, parent=None, thread=1):
    return SimpleNamespace(
        name=name, time_range=SimpleNamespace(start=start, end=end), cpu_parent=parent, thread=thread
    )


def test_sources_from_parents_and_from_the_open_frame():
    loop = _evt("transformers/trainer.py(1902): _run_epoch", 0, 100)
    step = _evt("accelerate/optimizer.py(152): step", 10, 20, parent=loop)
    torch_frame = _evt("torch/optim/adamw.py(40): step", 11, 19, parent=step)
    item = _evt("aten::_local_scalar_dense", 12, 13, parent=torch_frame)
    runtime = _evt("cudaStreamSynchronize", 30, 31)  # no parent: the profiler linked it to no frame
    outside = _evt("cudaStreamSynchronize", 200, 201)
    other_thread = _evt("cudaStreamSynchronize", 15, 16, thread=7)
    where = _Frames([loop, step, torch_frame, item, runtime, outside, other_thread])
    assert where.source(item) == "accelerate/optimizer.py(152): step < transformers/trainer.py(1902): _run_epoch"
    assert where.source(runtime) == "transformers/trainer.py(1902): _run_epoch"
    assert where.source(other_thread).startswith("accelerate/optimizer.py(152): step")  # any thread's frame
    assert where.source(outside) == "?"


def test_argument_checks():
    with pytest.raises(SystemExit):
        main(["--start", "2", "--steps", "3", "--", "--model", "tiny-qwen3"])
    with pytest.raises(SystemExit):
        main(["--start", "3", "--steps", "2"])  # no varpack sft flags
    with pytest.raises(SystemExit):  # the run ends before the profiled window
        main(["--start", "3", "--steps", "2", "--", "--model", "tiny-qwen3", "--max-steps", "4"])
    with pytest.raises(SystemExit):  # flags matched whole, as varpack sft: no abbreviation of its own flags
        main(["--start", "3", "--steps", "2", "--host-sample", "--", "--model", "tiny-qwen3"])
    with pytest.raises(SystemExit):  # ... nor of varpack sft's
        main(["--start", "3", "--steps", "2", "--", "--model", "tiny-qwen3", "--packing-len", "256"])


def test_a_run_by_epochs_passes_the_window_check(monkeypatch):
    """``--epochs`` leaves max_steps at -1 (run by epochs): not a run that ends before the window."""
    import varpack.train.sft as sft

    def ran(config):
        raise RuntimeError(f"ran {config.max_steps}")

    monkeypatch.setattr(sft, "run_sft", ran)
    with pytest.raises(RuntimeError, match="ran -1"):
        main(["--start", "3", "--steps", "2", "--host-samples", "--", "--model", "tiny-qwen3", "--epochs", "1"])


@pytest.mark.slow
def test_cpu_smoke_run(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main([
        "--start", "2", "--steps", "1", "--out", str(out), "--", "--model", "tiny-qwen3", "--packing-length",
        "1024", "--max-steps", "3", "--overflow", "drop", "--no-save", "--output-dir", str(tmp_path / "o"),
    ])  # fmt: skip
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and r["steps_profiled"] == [2, 3]
    assert r["wall_ms_per_step_unprofiled"] > 0 and r["wall_ms_per_step"] > 0
    total = sum(r["kernel_ms_per_step"].values())
    assert total == pytest.approx(r["kernel_total_ms_per_step"], rel=1e-6)
    # AdamW on the CPU reads its step counts on the host: each such read named with the Python line making it
    reads = [s for s in r["syncs"] if s["call"] == "aten::_local_scalar_dense"]
    assert reads and all(s["source"] != "?" for s in reads)
    printed = capsys.readouterr().out
    assert "wall (no profiler)" in printed
    # a CPU run copies nothing to a device: neither the header nor the JSON speaks of CUDA copies
    assert "[cpu]" in printed and "non-blocking" not in printed and "non-blocking" not in r["batch_copies"]


@pytest.mark.slow
def test_cpu_smoke_run_with_host_samples(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main([
        "--start", "2", "--steps", "1", "--host-samples", "--out", str(out), "--", "--model", "tiny-qwen3",
        "--packing-length", "1024", "--max-steps", "4", "--overflow", "drop", "--no-save", "--output-dir",
        str(tmp_path / "o"),
    ])  # fmt: skip
    assert rc == 0
    hs = json.loads(out.read_text())["host_samples"]
    assert hs["steps"] == [3, 4] and hs["samples"] > 0 and hs["wall_ms_per_step"] > 0
    # the optimizer step and the model's forward run inside Trainer's training loop in every sample
    loop = [r for r in hs["inclusive"] if r["where"].endswith("trainer.py:_inner_training_loop")]
    assert loop and loop[0]["share"] > 0.5
    assert "host samples" in capsys.readouterr().out


def _spin(seconds):
    import time

    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _sleep(seconds):
    import time

    time.sleep(seconds)


def test_host_sampler_shares_follow_the_time_spent():
    sampler = HostSampler(interval_s=1e-3)
    sampler.start()
    try:
        _spin(0.3)
        _sleep(0.1)
    finally:
        sampler.stop()
    # every function sampled (threads left by earlier tests, e.g. inductor's compile workers blocked in a
    # read, take a full share for each frame of their stacks and can fill the default top 25)
    shares = {r["where"].split(":")[-1]: r["share"] for r in sampler.top("inclusive", n=10**9)}
    assert sampler.samples > 50
    assert 0.55 < shares["_spin"] < 0.95 and 0.1 < shares["_sleep"] < 0.45  # 3 : 1 of the time
    innermost = sampler.top("innermost", n=10**9)
    lines = [r["where"].split("(")[0] for r in innermost if "test_profile_sft.py" in r["where"]]
    assert lines[0].endswith("test_profile_sft.py:_spin")
    # stopped: no more samples
    n = sampler.samples
    _spin(0.05)
    assert sampler.samples == n


def _reads_the_device():
    warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)


def test_sync_sites_record_the_calling_line(monkeypatch):
    import torch

    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    sites = SyncSites()
    sites.start()
    try:
        for _ in range(2):  # one call site
            _reads_the_device()
        with pytest.warns(DeprecationWarning):  # any other warning is shown as before
            warnings.warn("unrelated", DeprecationWarning, stacklevel=1)
    finally:
        sites.stop()
    assert modes == ["warn", "default"]
    [(site, n)] = sites.sites.items()
    assert n == 2 and "_reads_the_device" in site.split(" < ")[0]
    _reads_the_device_after = sites.sites.copy()
    with pytest.warns(UserWarning):  # stopped: nothing recorded any more
        _reads_the_device()
    assert sites.sites == _reads_the_device_after
