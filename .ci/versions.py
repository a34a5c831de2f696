"""Print the Python and package versions the test run uses, before the tests, so that a version drift between
two CI runs (a venv that kept older versions: pip does not upgrade a dependency that is already satisfied) is
visible in the log. Reads package metadata only (imports nothing heavy)."""

from __future__ import annotations

import platform
import subprocess
import sys
from importlib import metadata

#: the packages whose versions change what the tests compute or accept
PACKAGES = (
    "torch",
    "transformers",
    "trl",
    "peft",
    "datasets",
    "accelerate",
    "numpy",
    "tokenizers",
    "triton",
    "pyarrow",
    "safetensors",
    "fla-core",
    "liger-kernel",
)


def main() -> int:
    print(f"python {platform.python_version()} ({sys.executable}) on {platform.platform()}")
    for name in PACKAGES:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            version = "not installed"
        print(f"  {name:<14} {version}")
    freeze = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True)
    lines = freeze.stdout.splitlines()
    print(f"pip freeze ({len(lines)} packages):")
    print("\n".join("  " + line for line in lines), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
