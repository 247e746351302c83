"""Issue 31, item 7: `tools/make_demo_grid.py` rewrote the tracked docs/demo-grid.png on every run (a few
pixels differ by one level between machines). It writes outputs/demo-grid.png by default and replaces an
existing file only with --force."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "make_demo_grid.py"


def test_an_existing_grid_is_not_replaced_without_force(tmp_path: Path) -> None:
    existing = tmp_path / "grid.png"
    existing.write_bytes(b"precious")
    result = subprocess.run(
        [sys.executable, str(TOOL), "--out", str(existing)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {existing} exists; pass --force to replace it"
    assert existing.read_bytes() == b"precious"
