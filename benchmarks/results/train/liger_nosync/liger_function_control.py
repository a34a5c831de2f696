# benchmarks/train.py with the liger backend on Liger's own Python function (its two host syncs): the control
import runpy
import sys

import varpack.ops.linear_ce.liger as L

L._liger_kernel_probe = lambda: (None, "Liger's function (control)")
sys.argv = ["benchmarks/train.py", *sys.argv[1:]]
runpy.run_path("benchmarks/train.py", run_name="__main__")
