"""What users type: a TRL script with TRL's own packing, the same script with varpack's drop-in, ``varpack sft``.

Three runs, each a subprocess started as a user starts it, on the same data file, the same model (a varpack
built-in, random init, the same ``--seed``), the same packing length and step count:

* ``trl``: ``python benchmarks/trl_user_script.py --trainer trl``: ``trl.SFTTrainer`` with TRL's strongest
  packing configuration (``packing=True``, BFD, ``padding_free=True``, the fastest HF attention that builds:
  FlashAttention-4 if installed, ``use_liger_kernel=True`` when liger-kernel is installed; see that script);
* ``varpack_trl``: the same script with ``--trainer varpack`` (``from varpack.train.trl import
  VarpackSFTTrainer``; ``packing`` / ``padding_free`` False, which the drop-in refuses, everything else the
  same);
* ``cli``: ``varpack sft --dtype <dtype> --model <model> --packing-length L --data <file> --overflow truncate
  --max-steps N --logging-steps K --no-save`` (README's command).

Data: the first chats of ``--data`` (JSON Lines chats) that fill exactly ``--steps`` packs of
``--packing-length`` tokens, written to one file that every run reads: chats are taken in file order (encoded
with the model's chat template, :func:`varpack.data.chat.encode_chat`) while their tokens stay within
``steps * packing_length * fill`` (fill 0.995; 0.85 with ``--small``); a chat longer than a pack, or one that
would pass that budget, is skipped; then the last ones are dropped until varpack's BFD plans exactly
``--steps`` packs. So every run trains one epoch of the same tokens, and nothing is
truncated. ``--small``: 40 generated short chats, ``tiny-qwen3``, packing length 128, 2 steps.

Measurement, the same for every run, from the run's own logs: Trainer prints each logging window's entry
(every ``--logging-steps`` steps) and its progress bar (every step); the benchmark reads both streams as they
come and stamps each line with its own clock. A window's seconds are the time between two printed log
entries (the first window: from the progress bar's ``0/N`` line); its tokens are the real tokens (no padding)
the run logged: TRL's ``num_tokens`` (cumulative; TRL's padding-free collator adds no pad tokens) or varpack's
``tokens_per_step`` x steps (``batch_stats``, pad tokens excluded). Trainer prints floats to 4 significant
digits, so token counts agree across runs to about 1e-4 (``tokens.spread``). The windows up to
``--warmup-steps`` are untimed (compiles, autotuning, FlashAttention-4's kernel builds); steady tokens/s =
tokens of the later windows / their seconds. Cold figures apart: seconds from the process start to training
start (progress bar ``0/N``: imports, data preparation, model build), to the end of the first step, and the
warm-up windows' tokens/s (the first round's: later rounds find compile caches on disk). ``--rounds`` rounds,
the runs in :func:`benchmarks._common.round_order` (two: trl, varpack_trl, cli, then cli, varpack_trl, trl);
figures averaged over rounds, each round's ratios to ``trl`` and to ``cli`` kept; a ratio on both sides of 1
is flagged order-dependent.

    python benchmarks/trl_user.py --data .gpu/data/code_alpaca.jsonl --out trl_user.json      # H200
    bash scripts/gpu.sh trl-user        # the same through the GPU runner (TRL_USER_ARGS adds flags)
    python benchmarks/trl_user.py --device cpu --small --out /tmp/trl_user.json             # CPU smoke run
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (  # noqa: E402
    REPO,
    add_common_args,
    checked_device,
    machine_info,
    markdown_table,
    merge_rounds,
    missing_rounds,
    run_rounds,
    write_json,
)

CONFIGS = ("trl", "varpack_trl", "cli")
SCRIPT = REPO / "benchmarks" / "trl_user_script.py"
DEFAULT_DATA = REPO / ".gpu" / "data" / "code_alpaca.jsonl"
#: Trainer's progress bar line of the training loop (no description before the percentage).
_BAR = re.compile(r"^\s*\d+%\|[^|]*\|\s*(\d+)/(\d+) \[")
#: Cold figures of a run (reported for the first round that measured it).
COLD_KEYS = ("time_to_train_s", "time_to_first_step_s", "first_step_s", "warmup_tokens_per_s")
#: Token counts of the runs agree within this relative spread (Trainer prints 4 significant digits).
TOKEN_RTOL = 1e-3


# ----------------------------------------------------------------------------------------------------------
# data: the chats that fill exactly --steps packs
# ----------------------------------------------------------------------------------------------------------


def generated_chats(n: int = 40, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` short two-turn chats of random words (the smoke run's data: 25-60 tokens each)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = "the a pack token sample list value python code loop index data model train step".split()

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(words, int(rng.integers(lo, hi))).tolist())

    return [{"messages": [{"role": "user", "content": text(2, 12)}, {"role": "assistant", "content": text(4, 30)}]}
            for _ in range(n)]  # fmt: skip


def read_chats(path: str | os.PathLike[str]) -> list[tuple[str, dict[str, Any]]]:
    """``[(line, row)]`` of a JSON Lines chat file (blank lines skipped).

    Raises:
        FileNotFoundError: no such file. ValueError: a line that is not JSON or has no ``messages`` (named
            by file and line).
    """
    out = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}, line {i}: not JSON ({exc})") from exc
            if not isinstance(row, dict) or "messages" not in row:
                raise ValueError(f"{path}, line {i}: no 'messages' field")
            out.append((line.rstrip("\n"), row))
    return out


def select_chats(
    lines: list[tuple[str, dict[str, Any]]], tokenizer: Any, packing_length: int, steps: int, fill: float
) -> tuple[list[str], dict[str, Any]]:
    """The chats (file order, a subsequence of ``lines``) whose BFD plan is exactly ``steps`` packs of
    ``packing_length``; see the module docstring.

    Returns:
        ``(JSON lines, info)``: samples, tokens, skipped overlong chats, planned packs, fill.

    Raises:
        ValueError: the file holds too few tokens for ``steps`` packs.
    """
    import numpy as np

    from varpack.data.chat import encode_chat
    from varpack.plan import plan_packs

    budget, total, chosen, lengths, overlong = int(steps * packing_length * fill), 0, [], [], 0
    for i, (line, row) in enumerate(lines):
        n = encode_chat(row["messages"], tokenizer, sample_id=i)["length"]
        if n > packing_length:
            overlong += 1
        elif total + n <= budget:
            chosen.append(line)
            lengths.append(n)
            total += n
        if budget - total < 16:
            break
    if total <= (steps - 1) * packing_length:
        raise ValueError(
            f"the data holds {total:,} tokens in chats of <= {packing_length} tokens: not enough for {steps} "
            f"packs of {packing_length}"
        )
    while plan_packs(np.asarray(lengths), packing_length, strategy="bfd").num_packs > steps:
        chosen.pop()
        total -= lengths.pop()
    packs = plan_packs(np.asarray(lengths), packing_length, strategy="bfd").num_packs
    info = {"samples": len(chosen), "tokens": total, "overlong_skipped": overlong, "packs_planned": packs,
            "fill": total / (packs * packing_length), "sample_length_mean": total / len(chosen),
            "sample_length_max": max(lengths)}  # fmt: skip
    return chosen, info


# ----------------------------------------------------------------------------------------------------------
# one run: a subprocess, its printed lines stamped as they come
# ----------------------------------------------------------------------------------------------------------


def command(config: str, args: argparse.Namespace, data: Path, out_dir: Path) -> list[str]:
    """The command line of run ``config``."""
    common = ["--model", args.model, "--packing-length", str(args.packing_length), "--data", str(data),
              "--max-steps", str(args.steps), "--logging-steps", str(args.logging_steps),
              "--seed", str(args.seed), "--output-dir", str(out_dir)]  # fmt: skip
    if config == "cli":
        exe = Path(sys.executable).with_name("varpack")
        head = [str(exe)] if exe.is_file() else [sys.executable, "-m", "varpack.cli.main"]
        return [*head, "sft", "--dtype", args.dtype, *common, "--overflow", "truncate", "--no-save"]
    trainer = "trl" if config == "trl" else "varpack"
    extra = ["--liger", args.liger, "--attn", args.trl_attn] + (["--torch-compile"] if args.trl_compile else [])
    return [sys.executable, str(SCRIPT), "--trainer", trainer, "--dtype", args.dtype, *common, *extra]


def run_stamped(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, list[tuple[float, str, str]]]:
    """Run ``cmd`` in its own process group; returns ``(returncode, [(seconds since start, "out"/"err",
    segment)])``, one segment per line or progress-bar update (split at ``\\n`` and ``\\r``). Past ``timeout``
    the group is killed (returncode -9)."""
    segments: list[tuple[float, str, str]] = []
    lock = threading.Lock()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            process_group=0)  # its own process group: a timeout kills it whole  # fmt: skip

    def reader(stream: Any, name: str) -> None:
        # a segment is stamped when its first byte arrives: tqdm writes "\r<bar>" and ends it only with the
        # next write
        buf, buf_t, fd = b"", 0.0, stream.fileno()
        while True:
            chunk = os.read(fd, 65536)
            now = time.perf_counter() - t0
            if not chunk:
                break
            parts = re.split(rb"[\r\n]", chunk)
            done = [(buf_t if buf else now, buf + parts[0])] + [(now, x) for x in parts[1:-1]]
            if len(parts) > 1:
                buf, buf_t = parts[-1], now
            else:
                done, buf, buf_t = [], buf + parts[0], buf_t if buf else now
            with lock:
                segments.extend((t, name, x.decode("utf-8", "replace")) for t, x in done if x.strip())
        if buf.strip():
            with lock:
                segments.append((buf_t, name, buf.decode("utf-8", "replace")))

    threads = [threading.Thread(target=reader, args=(s, n), daemon=True)
               for s, n in ((proc.stdout, "out"), (proc.stderr, "err"))]  # fmt: skip
    for t in threads:
        t.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    for t in threads:
        t.join(timeout=10)
    return rc, sorted(segments, key=lambda s: s[0])


def _number(v: Any) -> Any:
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def parse_run(segments: list[tuple[float, str, str]], config: str, args: argparse.Namespace) -> dict[str, Any]:
    """The figures of one run from its stamped output (module docstring).

    Raises:
        RuntimeError: no training progress bar, no log entries, a log entry without token counts, or fewer
            windows than ``--steps / --logging-steps``.
    """
    steps, k = args.steps, args.logging_steps
    t_begin = t_first = None
    logs: list[tuple[float, dict[str, Any]]] = []
    settings: dict[str, Any] = {}
    printed: list[str] = []
    for t, stream, seg in segments:
        bar = _BAR.match(seg) if stream == "err" else None
        if bar and int(bar.group(2)) == steps:
            n = int(bar.group(1))
            t_begin = t if t_begin is None and n == 0 else t_begin
            t_first = t if t_first is None and n >= 1 else t_first
            continue
        if stream != "out":
            continue
        text = seg.strip()
        if text.startswith("{'") and text.endswith("}"):
            try:
                entry = {key: _number(v) for key, v in ast.literal_eval(text).items()}
            except (ValueError, SyntaxError):
                entry = {}
            if "loss" in entry:
                logs.append((t, entry))
        elif text.startswith("trl_user_script {"):
            settings = json.loads(text.split(" ", 1)[1])
        elif len(printed) < 40:
            printed.append(seg.rstrip())
    if t_begin is None or t_first is None:
        raise RuntimeError("no training progress bar (0/N and 1/N) in the run's output")
    if len(logs) < steps // k:
        raise RuntimeError(f"{len(logs)} log entries with a loss, expected {steps // k}")
    windows, prev_t, prev_step, prev_cum = [], t_begin, 0, 0.0
    for i, (t, e) in enumerate(logs[: steps // k]):
        step = (i + 1) * k
        n = step - prev_step
        if "num_tokens" in e:  # TRL: cumulative real tokens
            tokens, prev_cum = e["num_tokens"] - prev_cum, e["num_tokens"]
        elif "tokens_per_step" in e:  # varpack: window mean of real tokens per step
            tokens = e["tokens_per_step"] * n
        else:
            raise RuntimeError(f"log entry at step {step} has neither num_tokens nor tokens_per_step: {e}")
        w = {"step_end": step, "steps": n, "tokens": tokens, "seconds": t - prev_t,
             "tokens_per_s": tokens / max(t - prev_t, 1e-9), "loss": e["loss"]}  # fmt: skip
        for key in ("tokens_per_second", "samples_per_step", "packs_per_step", "pack_fill"):
            if key in e:
                w["logged_" + key] = e[key]
        windows.append(w)
        prev_t, prev_step = t, step
    steady = [w for w in windows if w["step_end"] > args.warmup_steps]
    warm = [w for w in windows if w["step_end"] <= args.warmup_steps]
    s_tok, s_sec = sum(w["tokens"] for w in steady), sum(w["seconds"] for w in steady)
    total = sum(w["tokens"] for w in windows)
    row: dict[str, Any] = {
        "tokens_per_s": s_tok / s_sec, "steady_steps": sum(w["steps"] for w in steady),
        "steady_tokens": s_tok, "steady_seconds": s_sec, "total_tokens": total,
        "tokens_per_step_mean": total / steps, "fill": total / (steps * args.packing_length),
        "time_to_train_s": t_begin, "time_to_first_step_s": t_first, "first_step_s": t_first - t_begin,
        "warmup_tokens_per_s": (sum(w["tokens"] for w in warm) / sum(w["seconds"] for w in warm)) if warm else None,
        "loss_first_window": windows[0]["loss"], "loss_last_window": windows[-1]["loss"],
    }  # fmt: skip
    logged = [w for w in steady if "logged_tokens_per_second" in w]
    if logged:  # varpack's own figure (its window starts at the first micro-batch): a cross-check
        row["logged_tokens_per_s"] = sum(w["tokens"] for w in logged) / sum(
            w["tokens"] / w["logged_tokens_per_second"] for w in logged
        )
    if settings:
        row["settings"] = settings
        row["attention"] = settings.get("attention_running")
        row["rows_per_epoch"] = settings.get("rows_per_epoch")
    else:
        speed = [s for s in printed if s.startswith("speed")]
        row["attention"] = next((s.split("attention", 1)[1].split(",")[0].strip() for s in printed
                                 if s.startswith("model") and "attention" in s), None)  # fmt: skip
        row["speed_line"] = speed[0] if speed else None
        packs = [s for s in printed if s.strip().startswith("packs")]
        row["rows_per_epoch"] = int(packs[0].split()[1].replace(",", "")) if packs else None
    row["printed"] = printed
    row["windows"] = windows
    return row


def run_config(
    config: str, args: argparse.Namespace, data: Path, work: Path, counter: list[int], scratch: Path
) -> dict[str, Any]:
    """Run ``config`` once (its ``--output-dir`` under ``scratch``); its stamped output goes to
    ``work/<config>_<n>.log``.

    Raises:
        RuntimeError: the run failed or timed out (the output's last lines), or its output did not parse.
    """
    counter[0] += 1
    cmd = command(config, args, data, scratch / f"out_{config}_{counter[0]}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    t0 = time.perf_counter()
    rc, segments = run_stamped(cmd, env, args.run_timeout)
    wall = time.perf_counter() - t0
    log = work / f"{config}_{counter[0]}.log"
    log.write_text("".join(f"{t:9.3f} {s} {seg}\n" for t, s, seg in segments))
    if rc != 0:
        tail = " | ".join(seg.strip()[:200] for _, s, seg in segments[-6:])
        raise RuntimeError(f"exit {rc}{' (timed out)' if rc == -9 else ''} after {wall:.0f} s: {tail} (log {log})")
    return {**parse_run(segments, config, args), "command": shlex.join(cmd), "wall_s": wall, "log": str(log)}


# ----------------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------------


def token_check(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Total and steady token counts of every measured run of every round, and their relative spread."""
    runs = [r for m in rows for r in m["rounds"] if "total_tokens" in r]
    out: dict[str, Any] = {"rtol": TOKEN_RTOL}
    for key in ("total_tokens", "steady_tokens"):
        vals = [r[key] for r in runs]
        out[key] = {f"{r['config']}#{i}": r[key] for i, r in enumerate(runs)}
        out[key.replace("tokens", "spread")] = (max(vals) / min(vals) - 1.0) if vals else None
    out["agree"] = bool(runs) and all(out[k] <= TOKEN_RTOL for k in ("total_spread", "steady_spread"))
    return out


def table(rows: list[dict[str, Any]]) -> str:
    body = []
    for r in rows:
        per_round = " / ".join(f"{x['tokens_per_s']:,.0f}" if "tokens_per_s" in x else "-" for x in r["rounds"])
        note = "; ".join(missing_rounds(r) + (["ORDER-DEPENDENT"] if r.get("order_dependent") else [])
                         + ([r["speed_line"]] if r.get("speed_line") else []))  # fmt: skip
        body.append([r["config"], r.get("attention"), r.get("tokens_per_s"), per_round, r.get("vs_best_peer"),
                     r.get("vs_cli"), r.get("time_to_first_step_s"), r.get("warmup_tokens_per_s"),
                     r.get("total_tokens"), r.get("rows_per_epoch"), r.get("fill"),
                     note or r.get("error", "")])  # fmt: skip
    return markdown_table(["run", "attention", "steady tokens/s", "per round", "vs trl", "vs cli",
                           "s to first step", "warm-up tokens/s", "tokens", "rows", "fill", "notes"], body)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, small="CPU smoke run: tiny-qwen3, 40 generated chats, 2 packs of 128 tokens")
    p.add_argument("--data", default=None, help=f"JSON Lines chats (default {DEFAULT_DATA.relative_to(REPO)})")
    p.add_argument("--model", default=None, help="built-in model (default qwen3-0.6b-shape; --small tiny-qwen3)")
    p.add_argument("--packing-length", type=int, default=None, help="default 8192 (--small 128)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps = packs (default 60, --small 2)")
    p.add_argument("--logging-steps", type=int, default=None, help="log window (default 10, --small 1)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="untimed steps, a multiple of --logging-steps (default 20, --small 1)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=2, help="2: trl, varpack_trl, cli then reversed")
    p.add_argument("--runs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    p.add_argument("--liger", choices=("auto", "on", "off"), default="auto", help="the TRL script's --liger")
    p.add_argument("--trl-attn", default="auto", help="the TRL script's --attn (auto: FA4 > FA2 > flex > sdpa)")
    p.add_argument("--trl-compile", action="store_true", help="the TRL script's --torch-compile")
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds per run before it is killed")
    p.add_argument("--keep", default=None, help="folder for the data file and the runs' logs (default: temporary)")
    args = p.parse_args(argv)
    device = checked_device(p, args)
    small = args.small
    args.model = args.model or ("tiny-qwen3" if small else "qwen3-0.6b-shape")
    args.packing_length = args.packing_length or (128 if small else 8192)
    args.steps = args.steps or (2 if small else 60)
    args.logging_steps = args.logging_steps or (1 if small else 10)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (1 if small else 20)
    runs = [c.strip() for c in args.runs.split(",") if c.strip()]
    if unknown := sorted(set(runs) - set(CONFIGS)):
        p.error(f"unknown run(s) {unknown}; choose from {', '.join(CONFIGS)}")
    if args.steps % args.logging_steps or args.warmup_steps % args.logging_steps:
        p.error("--steps and --warmup-steps must be multiples of --logging-steps")
    if args.warmup_steps >= args.steps:
        p.error("--warmup-steps must leave at least one logging window")

    from varpack.models import load_tokenizer_for

    tmp = tempfile.TemporaryDirectory(prefix="varpack-trl-user-")
    work = Path(args.keep or tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    try:
        if small and args.data is None:
            chats, source = [(json.dumps(c), c) for c in generated_chats(seed=args.seed)], "40 generated chats"
        else:
            path = Path(args.data) if args.data else DEFAULT_DATA
            chats, source = read_chats(path), str(path)
        lines, data_info = select_chats(chats, load_tokenizer_for(args.model), args.packing_length,
                                        args.steps, 0.85 if small else 0.995)  # fmt: skip
        data = work / "data.jsonl"
        data.write_text("\n".join(lines) + "\n")
        data_info = {"source": source, "file": str(data), **data_info}
        print(f"data: {data_info['samples']} chats of {source}, {data_info['tokens']:,} tokens, "
              f"{data_info['packs_planned']} packs of {args.packing_length} (fill {data_info['fill']:.4f})",
              file=sys.stderr, flush=True)  # fmt: skip
        counter = [0]

        def save_partial(done: list[list[dict[str, Any]]]) -> None:  # what finished, should a later run hang
            write_json(args.out, {"benchmark": "trl_user", "partial": True, "args": vars(args), "data": data_info,
                                  "rounds": done})  # fmt: skip

        rounds = run_rounds(runs, lambda c: run_config(c, args, data, work, counter, Path(tmp.name)), args.rounds,
                            after_each=save_partial)  # fmt: skip
        rows = merge_rounds(rounds, "tokens_per_s", ("trl",), baseline="cli")
        for r in rows:  # cold figures: the first measured round's (later ones find compile caches on disk)
            first = next((x for x in r["rounds"] if "tokens_per_s" in x), None)
            r.update({k: first[k] for k in COLD_KEYS} if first else {})
        tokens = token_check(rows)
        text = table(rows)
        print(f"\nsteady state: steps {args.warmup_steps + 1}-{args.steps} ({args.model}, packing length "
              f"{args.packing_length}, {data_info['samples']} chats, {args.rounds} round(s))\n{text}")  # fmt: skip
        print(f"tokens: total spread {tokens['total_spread']}, steady spread {tokens['steady_spread']} "
              f"(agree within {TOKEN_RTOL}: {tokens['agree']})")  # fmt: skip
        write_json(args.out, {"benchmark": "trl_user", "machine": machine_info(device), "args": vars(args),
                              "data": data_info, "rows": rows, "tokens": tokens, "table": text})  # fmt: skip
    finally:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
