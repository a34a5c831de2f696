"""Multi-process launches for the CPU tests (gloo): torchrun and accelerate's launcher on the loopback address,
with a hard timeout that stops the launcher and every rank.

Two things make a launch hermetic on any machine:

* the rendezvous address is ``127.0.0.1`` (``--local-addr`` / ``--main_process_ip``): by default torchrun
  hands its workers ``socket.getfqdn()`` as the store address, and where the host name does not resolve
  (a CI container, a laptop off its network) every rank retries the connection for 30 minutes;
* on a timeout the whole tree is killed: torchrun starts each worker with ``setsid`` (a process group of its
  own), so killing the launcher's process group leaves the ranks alive, holding the output open.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence

LOOPBACK = "127.0.0.1"


def torchrun(nproc: int, *args: object) -> list[str]:
    """The command ``torchrun --standalone --nproc-per-node NPROC ARGS...`` with the rendezvous on the loopback."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", LOOPBACK,
            "--nproc-per-node", str(nproc), *map(str, args)]  # fmt: skip


def accelerate_launch(nproc: int, *args: object) -> list[str]:
    """``accelerate launch --multi_gpu --num_processes NPROC`` (gloo on CPUs), its main process on the loopback."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
            "--num_machines", "1", "--main_process_ip", LOOPBACK, "--main_process_port", "0",
            *map(str, args)]  # fmt: skip


def _kill_tree(pid: int) -> None:
    """Kill ``pid`` and every process under it (torchrun's ranks are not in its process group)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def run(cmd: Sequence[str], *, timeout: float, env: dict | None = None, cwd: object = None,
        ) -> subprocess.CompletedProcess:  # fmt: skip
    """Run a launch command; its stdout and stderr go to files (no pipe a surviving rank could hold open).

    Raises AssertionError naming the command and the end of its output when it runs past ``timeout`` seconds,
    after killing the launcher and every process under it."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            list(cmd), stdout=out, stderr=err, text=True, env=env, cwd=cwd, preexec_fn=os.setsid
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            proc.wait()
            out.seek(0)
            err.seek(0)
            raise AssertionError(
                f"{' '.join(cmd)} did not finish in {timeout:g} s:\n{out.read()[-2000:]}\n{err.read()[-4000:]}"
            ) from None
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(list(cmd), rc, out.read(), err.read())


def run_ranks(script: str, tmp_path: object, *, nproc: int = 2, timeout: float = 600) -> list[dict]:
    """Write ``script`` (a ``str.format`` template with ``{root}``, the repository, and ``{out}``, ``tmp_path``)
    to ``tmp_path/run.py``, launch it on ``nproc`` loopback ranks (:func:`torchrun`, :func:`run`) and return each
    rank's ``tmp_path/result{rank}.json``, in rank order.

    Raises:
        AssertionError: the launch failed (its stderr's tail in the message).
    """
    import json
    import pathlib

    out = pathlib.Path(str(tmp_path))
    root = str(pathlib.Path(__file__).parents[1])
    path = out / "run.py"
    path.write_text(script.format(root=root, out=str(out)))
    proc = run(torchrun(nproc, path), timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"result{r}.json").read_text()) for r in range(nproc)]
