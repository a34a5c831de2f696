"""tests/_launch.py: a launch past its timeout fails by name, and every process under it is killed, also one
that left the launcher's process group (as torchrun's ranks do)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from tests import _launch as launch

_TREE = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=os.setsid)
open(sys.argv[1], "w").write(str(child.pid))
print("launched", flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_timeout_kills_the_whole_tree_and_names_the_command(tmp_path):
    pid_file = tmp_path / "pid"
    with pytest.raises(AssertionError, match=r"did not finish in 5 s:\nlaunched"):
        launch.run([sys.executable, "-c", _TREE, str(pid_file)], timeout=5)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def test_a_finished_launch_returns_its_output():
    done = launch.run([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                      timeout=60)  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


def test_torchrun_command_rendezvous_on_the_loopback():
    cmd = launch.torchrun(2, "script.py", "--x", 1)
    assert cmd[cmd.index("--local-addr") + 1] == "127.0.0.1" and cmd[-3:] == ["script.py", "--x", "1"]
    assert os.path.basename(cmd[0]).startswith("python")
