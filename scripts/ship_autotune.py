"""Add fla's autotune results from a GPU machine to the ones varpack ships (varpack/ops/fla_autotune.json).

    python scripts/ship_autotune.py autotune.tar.xz [more.tar.xz | triton-cache-folder ...]

The inputs are what ``bash scripts/gpu.sh`` leaves (``$OUT/autotune.tar.xz``: Triton's ``<key>/<kernel>.autotune.json``
files) or a Triton cache folder. Files already shipped are kept as they are (a shipped result is never retuned
silently); the new ones are added, sorted by name. Only results of the stack named by the file's ``stack``
(GPU, Triton, fla-core) belong there: Triton reads a file only under its own hash of that stack, so a result from
another stack is inert but dead weight. Prints how many files were added.
"""

from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

SHIPPED = Path(__file__).resolve().parents[1] / "varpack" / "ops" / "fla_autotune.json"


def _results(source: Path) -> dict[str, dict]:
    """``{"<key>/<kernel>.autotune.json": content}`` of a tar archive or a Triton cache folder."""
    found: dict[str, dict] = {}
    if source.is_dir():
        for path in source.glob("*/*.autotune.json"):
            found[path.relative_to(source).as_posix()] = json.loads(path.read_text(encoding="utf-8"))
        return found
    with tarfile.open(source) as archive:
        for member in archive.getmembers():
            parts = Path(member.name).parts
            parts = parts[1:] if parts and parts[0] == "." else parts
            if member.isfile() and len(parts) == 2 and parts[1].endswith(".autotune.json"):
                found["/".join(parts)] = json.loads(archive.extractfile(member).read().decode("utf-8"))
    return found


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    shipped = json.loads(SHIPPED.read_text(encoding="utf-8"))
    files = shipped["files"]
    added = 0
    for arg in argv:
        source = Path(arg)
        if not source.exists():
            print(f"ship_autotune: {arg}: no such file or folder", file=sys.stderr)
            return 2
        for name, content in _results(source).items():
            if not isinstance(content.get("key"), list) or not content.get("configs_timings"):
                print(f"ship_autotune: {arg}: {name} is not a Triton autotune result", file=sys.stderr)
                return 2
            if name not in files:
                files[name] = content
                added += 1
    shipped["files"] = dict(sorted(files.items()))
    SHIPPED.write_text(json.dumps(shipped, indent=1) + "\n", encoding="utf-8")
    print(f"ship_autotune: {added} added, {len(files)} shipped ({SHIPPED})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
