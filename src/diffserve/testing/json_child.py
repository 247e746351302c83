"""A Python snippet run in a fresh interpreter that reports one JSON line: for measurements that must see
a process of their own (its resident set, its VmHWM peak), not a test worker's history."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def run_json_child(code: str, *args: str, timeout: float) -> tuple[dict[str, Any], str]:
    """Run `code` with `args` as its `sys.argv[1:]`; its last stdout line parsed as JSON, and its stderr
    (the log). AssertionError, with the end of that log, when it exits non-zero."""
    result = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr
