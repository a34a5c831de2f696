"""Where ``varpack sft``, run as a user types it, spends its steps: device busy time, host gaps, and the host
syncs that open them.

The command line after ``--`` is ``varpack sft``'s (parsed by the CLI's own parser, run by
:func:`varpack.train.sft.run_sft`); one Trainer callback is added. It times optimizer steps
``[--start - --steps, --start)`` without the profiler (device synchronised at both ends: the true step time),
then profiles steps ``[--start, --start + --steps)`` with ``torch.profiler`` (``with_stack``) and reports:

- wall ms per step (unprofiled and profiled), device busy ms per step (the union of kernel intervals), host gap
  ms per step (wall - busy: the device waiting for the host), and kernel time per category
  (:mod:`benchmarks._profile_attr`, as benchmarks/profile_step.py);
- every host call that waits for the device (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
  ``cudaEventSynchronize``, a blocking ``cudaMemcpy``, ``aten::_local_scalar_dense``), per step, with the wait
  and the Python line that made it (where the profiler records Python frames);
- on CUDA, every synchronising call torch reports under ``torch.cuda.set_sync_debug_mode("warn")`` in the
  profiled window, with the Python lines that made it (:class:`SyncSites`; on any torch build);
- the longest device idle intervals and the host calls running during each;
- with ``--host-samples``, a third window of ``--steps`` steps after the profiled one in which a thread samples
  every other thread's Python stack every millisecond (:class:`HostSampler`, no profiler): the share of the
  host's wall time inside each function (inclusive) and on each line (innermost), i.e. where a host-bound step
  spends its time.

Both timed windows start from a synchronised device, so each counts one pipeline fill: use ``--steps`` of 5 or
more. ``--start`` must leave the warm-up (compiles, graph captures, autotuning) behind it.

    python benchmarks/profile_sft.py --start 30 --steps 6 --out p.json -- --model qwen3-0.6b-shape \\
        --dtype bfloat16 --packing-length 8192 --data code_alpaca.jsonl --max-steps 40
    python benchmarks/profile_sft.py --start 3 --steps 2 -- --model tiny-qwen3 --packing-length 256 \\
        --overflow split --max-steps 6 --no-save                           # CPU smoke run (op time)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _profile_attr as A  # noqa: E402

#: host calls that wait for the device (CUDA runtime calls; the ATen op reading a device scalar)
SYNC_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "aten::_local_scalar_dense",
)
_PY_FRAME = re.compile(r"\.py\(\d+\): ")


def _frames(evt: Any) -> list[str]:
    """The Python frames (the profiler's ``with_stack`` events, ``path.py(line): function``) among ``evt`` and
    its ancestors, innermost first, torch's own left out."""
    found, e = [], evt
    while e is not None:
        if _PY_FRAME.search(e.name) and not e.name.startswith(("torch/", "<")):
            found.append(e.name.split("site-packages/")[-1])
        e = e.cpu_parent
    return found


class _Frames:
    """Where a host event came from: its own Python ancestors, else (a CUDA runtime call, which the profiler
    does not link to the Python frames) the innermost Python frame of its thread open at its start."""

    def __init__(self, events: list[Any]) -> None:
        from bisect import bisect_right

        self._bisect = bisect_right
        by_thread: dict[Any, list[Any]] = {}
        for e in events:
            if _PY_FRAME.search(e.name) and not e.name.startswith(("torch/", "<")):
                by_thread.setdefault(e.thread, []).append(e)
        by_thread[None] = [e for v in by_thread.values() for e in v]  # any thread (ids may differ per source)
        self._threads = {t: sorted(v, key=lambda e: e.time_range.start) for t, v in by_thread.items()}
        self._starts = {t: [e.time_range.start for e in v] for t, v in self._threads.items()}

    def source(self, evt: Any, frames: int = 3) -> str:
        found = _frames(evt)
        for thread in (evt.thread, None):
            if found:
                break
            spans, starts = self._threads.get(thread, []), self._starts.get(thread, [])
            t = evt.time_range.start
            for i in range(self._bisect(starts, t) - 1, -1, -1):
                if spans[i].time_range.end >= t:
                    found = _frames(spans[i])
                    break
        return " < ".join(found[:frames]) if found else "?"


class SyncSites:
    """While on, every synchronising CUDA call (``torch.cuda.set_sync_debug_mode("warn")``) is recorded with the
    innermost Python frames outside torch that made it: the sources of the host waits, on any torch (the
    profiler's Python frames are not recorded by every build)."""

    def __init__(self) -> None:
        self.sites: dict[str, int] = {}
        self._saved: Any = None

    def start(self) -> None:
        import torch

        self._saved = (warnings.showwarning, warnings.filters[:])
        warnings.simplefilter("always")

        def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            if "synchroniz" not in str(message):
                return self._saved[0](message, category, filename, lineno, file, line)
            frames = [
                f"{f.filename.split('site-packages/')[-1]}({f.lineno}): {f.name}"
                for f in reversed(traceback.extract_stack())
                if "/torch/" not in f.filename and "warnings" not in f.filename and f.filename != __file__
            ]
            key = " < ".join(frames[:3]) or "?"
            self.sites[key] = self.sites.get(key, 0) + 1

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        import torch

        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning, warnings.filters[:] = self._saved


_IDLE_FILES = ("/threading.py", "/queue.py", "/selectors.py")


class HostSampler:
    """Samples the Python stacks of every other thread every ``interval_s`` from a background thread
    (``sys._current_frames``; the training thread, and autograd's device threads, where the backward of a CUDA
    step runs its Python) while on: ``inclusive`` gives each function (``path:function``) on a stack,
    ``innermost`` the line being run, the seconds since the previous sample (``seconds`` in all: the wall time
    sampled; ``samples`` taken). Shares are of the wall time, so threads running at once add up past 100%.
    Threads waiting in ``threading`` / ``queue`` are left out. Weighting by time, not
    by count: a thread running Python holds the GIL, so the sampler gets it only at the interpreter's switch
    interval (5 ms), while a thread waiting in C (a sleep, a device sync) lets it sample every ``interval_s``.
    Frames of this script are left out."""

    def __init__(self, interval_s: float = 1e-3) -> None:
        import threading

        self.interval_s = interval_s
        self.inclusive: dict[str, float] = {}
        self.innermost: dict[str, float] = {}
        self.samples = 0
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread: Any = None

    @staticmethod
    def _name(code: Any) -> str:
        path = code.co_filename.split("site-packages/")[-1]
        return f"{path}:{code.co_name}"

    def _run(self) -> None:
        import threading

        me, last = threading.get_ident(), time.perf_counter()
        while not self._stop.wait(self.interval_s):
            frames = sys._current_frames()
            now = time.perf_counter()
            dt, last = now - last, now
            self.samples += 1
            self.seconds += dt
            for ident, frame in frames.items():
                # threads parked in threading / queue waits (tqdm's monitor, a loader's idle worker) do no work
                if ident != me and not frame.f_code.co_filename.endswith(_IDLE_FILES):
                    self._add(frame, dt)

    def _add(self, frame: Any, dt: float) -> None:
        seen, first = set(), True
        while frame is not None:
            code = frame.f_code
            if code.co_filename != __file__:
                name = self._name(code)
                if first:
                    line = f"{name}({frame.f_lineno})"
                    self.innermost[line] = self.innermost.get(line, 0.0) + dt
                    first = False
                if name not in seen:
                    seen.add(name)
                    self.inclusive[name] = self.inclusive.get(name, 0.0) + dt
            frame = frame.f_back

    def start(self) -> None:
        import threading

        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="host-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def top(self, which: str, n: int = 25) -> list[dict[str, Any]]:
        """The ``n`` ``"inclusive"`` functions or ``"innermost"`` lines with the most time, with their share of
        the sampled time."""
        times = self.inclusive if which == "inclusive" else self.innermost
        total = max(self.seconds, 1e-12)
        rows = sorted(times.items(), key=lambda kv: -kv[1])[:n]
        return [{"share": t / total, "seconds": t, "where": k} for k, t in rows]


class ProfileWindow:
    """Trainer callback (mixed with ``transformers.TrainerCallback`` by :func:`main`, so that ``--help`` does not
    import transformers): times steps ``[start - steps, start)``, profiles ``[start, start + steps)``; with a
    :class:`HostSampler`, samples the host over ``[start + steps, start + 2 * steps)``."""

    def __init__(
        self,
        start: int,
        steps: int,
        cuda: bool,
        sync_sites: SyncSites | None = None,
        sampler: HostSampler | None = None,
    ) -> None:
        self.start, self.steps, self.cuda, self.sync_sites, self.sampler = start, steps, cuda, sync_sites, sampler
        self.sampled_s: float | None = None
        self.prof: Any = None
        self.t0 = 0.0
        self.timed_s: float | None = None
        self.profiled_s: float | None = None

    def _sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if state.global_step == self.start - self.steps:
            self._sync()
            self.t0 = time.perf_counter()
        elif state.global_step == self.start and self.prof is None:
            self._sync()
            self.timed_s = time.perf_counter() - self.t0
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=acts, record_shapes=True, with_stack=True)
            self.prof.__enter__()
            if self.sync_sites is not None:
                self.sync_sites.start()
            self.t0 = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.prof is not None and self.profiled_s is None and state.global_step == self.start + self.steps:
            if self.sync_sites is not None:
                self.sync_sites.stop()
            self._sync()
            self.profiled_s = time.perf_counter() - self.t0
            self.prof.__exit__(None, None, None)
            if self.sampler is not None:
                self.t0 = time.perf_counter()
                self.sampler.start()
        elif (
            self.sampler is not None
            and self.sampled_s is None
            and self.profiled_s is not None
            and state.global_step == self.start + 2 * self.steps
        ):
            self.sampler.stop()
            self._sync()
            self.sampled_s = time.perf_counter() - self.t0


def _syncs(events: list[Any], steps: int, where: _Frames) -> list[dict[str, Any]]:
    from torch.autograd import DeviceType

    rows: dict[tuple[str, str], list[float]] = {}
    for e in events:
        if e.device_type != DeviceType.CPU or e.name not in SYNC_CALLS:
            continue
        key = (e.name, where.source(e))
        rows.setdefault(key, []).append(e.time_range.end - e.time_range.start)
    out = [
        {"call": k[0], "source": k[1], "per_step": len(v) / steps, "wait_ms_per_step": sum(v) / steps / 1e3}
        for k, v in rows.items()
    ]
    return sorted(out, key=lambda r: -r["wait_ms_per_step"])


def _idle_gaps(
    events: list[Any], device_events: list[A.Event], where: _Frames, top: int = 8
) -> list[dict[str, Any]]:
    """The longest intervals between device work, with the host calls open at their midpoint."""
    from torch.autograd import DeviceType

    spans = sorted((e.start_us, e.start_us + e.dur_us) for e in device_events if not e.is_annotation)
    gaps, end = [], None
    for a, b in spans:
        if end is not None and a > end:
            gaps.append((a - end, end, a))
        end = b if end is None else max(end, b)
    host = [e for e in events if e.device_type == DeviceType.CPU]
    out = []
    for length, a, b in sorted(gaps, reverse=True)[:top]:
        mid = (a + b) / 2
        open_calls = [e for e in host if e.time_range.start <= mid <= e.time_range.end]
        inner = min(open_calls, key=lambda e: e.time_range.end - e.time_range.start, default=None)
        out.append({
            "idle_ms": length / 1e3,
            "host_innermost": inner.name if inner is not None else "(no profiled host call)",
            "source": where.source(inner) if inner is not None else "",
        })  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sft_argv = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--start", type=int, default=30, help="first profiled optimizer step (default 30)")
    p.add_argument("--steps", type=int, default=6, help="steps timed, then steps profiled (default 6)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--top", type=int, default=20, help="kernels listed by device time (default 20)")
    p.add_argument(
        "--blocking-copies",
        action="store_true",
        help="the A/B control: batches copied to the device with blocking copies (Trainer's default) instead "
        "of varpack's non-blocking ones",
    )
    p.add_argument(
        "--host-samples",
        action="store_true",
        help="then sample the host's Python stack over --steps more steps (needs --max-steps >= start + 2 * steps)",
    )
    args = p.parse_args(own)
    if args.start < args.steps or args.steps < 1:
        p.error("--start must be >= --steps >= 1 (the timed window precedes the profiled one)")
    if not sft_argv:
        p.error("give varpack sft's flags after --")

    import torch

    import varpack.train.sft as sft
    from varpack.cli import sft as cli_sft

    parser = argparse.ArgumentParser(prog="varpack sft", allow_abbrev=False)  # as the CLI: flags matched whole
    cli_sft.add_sft_arguments(parser)
    config = cli_sft.config_from_args(parser.parse_args(sft_argv))
    end = args.start + (2 if args.host_samples else 1) * args.steps
    if config.max_steps is not None and 0 < config.max_steps < end:  # -1: run by --epochs
        p.error(f"--max-steps {config.max_steps} ends before the last window ({end})")
    cuda = torch.cuda.is_available()
    sites = SyncSites() if cuda else None
    sampler = HostSampler() if args.host_samples else None
    from transformers import TrainerCallback

    callback = type("ProfileWindowCallback", (ProfileWindow, TrainerCallback), {})
    window = callback(args.start, args.steps, cuda, sites, sampler)
    build = sft.build_sft

    def build_with_window(*a: Any, **k: Any) -> Any:
        run = build(*a, **k)
        run.trainer.add_callback(window)
        return run

    copies = sft.non_blocking_copies
    sft.build_sft = build_with_window
    if args.blocking_copies:
        sft.non_blocking_copies = lambda training_args: training_args.accelerator_config
    try:
        run = sft.run_sft(config)
    finally:
        sft.build_sft, sft.non_blocking_copies = build, copies
    if window.prof is None or window.profiled_s is None or window.timed_s is None:
        print("the profiled window was not reached (fewer steps ran?)", file=sys.stderr)
        return 1
    events = list(window.prof.events())
    device = "cuda" if cuda else "cpu"
    vocab = int(run.model.config.get_text_config().vocab_size)
    dev_events = A.events_from_profiler(events, vocab, device)
    attr = A.attribute(dev_events, device=device, top=args.top)
    where = _Frames(events)
    wall_us = window.profiled_s * 1e6
    figures = A.per_step(attr, args.steps, wall_us)
    tokens = [h.get("tokens_per_second") for h in run.history if h.get("tokens_per_second")]
    result = {
        "command": "varpack sft " + " ".join(sft_argv),
        "batch_copies": (
            "none (a CPU run copies nothing to a device)" if not cuda
            else "blocking" if args.blocking_copies
            else "non-blocking (varpack sft's default on CUDA)"
        ),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "steps_timed": [args.start - args.steps, args.start],
        "steps_profiled": [args.start, args.start + args.steps],
        "wall_ms_per_step_unprofiled": window.timed_s * 1e3 / args.steps,
        **figures,
        "syncs": _syncs(events, args.steps, where),
        "longest_idle": _idle_gaps(events, dev_events, where) if cuda else [],
        "tokens_per_second_logged": tokens,
        "sync_sites": (
            [{"per_step": n / args.steps, "source": k} for k, n in sorted(sites.sites.items(), key=lambda kv: -kv[1])]
            if sites is not None
            else []
        ),
    }
    if sampler is not None:
        if window.sampled_s is None:
            print("the host-sampled window was not reached (fewer steps ran?)", file=sys.stderr)
            return 1
        result["host_samples"] = {
            "steps": [args.start + args.steps, args.start + 2 * args.steps],
            "wall_ms_per_step": window.sampled_s * 1e3 / args.steps,
            "samples": sampler.samples,
            "inclusive": sampler.top("inclusive", 40),
            "innermost": sampler.top("innermost", 25),
        }
    ms = "ms/step"
    copies = f", {result['batch_copies']} batch copies" if cuda else ""
    print(f"\n{result['command']}  [{result['device']}{copies}]")
    print(f"wall (no profiler)   {result['wall_ms_per_step_unprofiled']:8.2f} {ms}")
    print(f"wall (profiled)      {figures['wall_ms_per_step']:8.2f} {ms}")
    print(f"device busy          {figures['busy_ms_per_step']:8.2f} {ms}")
    print(f"host gaps            {figures['host_gap_ms_per_step']:8.2f} {ms}")
    for cat, v in sorted(figures["kernel_ms_per_step"].items(), key=lambda kv: -kv[1]):
        print(f"  {cat:20s} {v:8.2f} {ms}")
    print("host waits for the device (per step):")
    for r in result["syncs"][:12]:
        print(f"  {r['call']:28s} x{r['per_step']:6.1f}  {r['wait_ms_per_step']:7.3f} ms  {r['source']}")
    if result["sync_sites"]:
        print('synchronising CUDA calls (torch.cuda.set_sync_debug_mode("warn"), per step):')
        for r in result["sync_sites"][:12]:
            print(f"  x{r['per_step']:6.1f}  {r['source']}")
    if result["longest_idle"]:
        print("longest device idle intervals:")
        for g in result["longest_idle"]:
            print(f"  {g['idle_ms']:7.3f} ms  {g['host_innermost']}  {g['source']}")
    if sampler is not None:
        hs = result["host_samples"]
        print(f"host samples (steps {hs['steps'][0]}-{hs['steps'][1]}, {hs['wall_ms_per_step']:.2f} ms/step, "
              f"{hs['samples']} samples): functions (inclusive share of the host's time)")  # fmt: skip
        for r in hs["inclusive"][:30]:
            print(f"  {100 * r['share']:5.1f}%  {r['where']}")
        print("  lines running (innermost):")
        for r in hs["innermost"][:15]:
            print(f"  {100 * r['share']:5.1f}%  {r['where']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
