"""The short form of `benchmarks/bench_fastercache_cfg.py`: on a tiny SD3 both sides skip the same steps'
negative branch, run the same attention calls and give the same image within one uint8 level (on one thread
SD3's exact images differ by as much), and the table says so."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_fastercache_cfg.py"


def test_short_run_matches_the_hook() -> None:
    args = [
        "--layers",
        "2",
        "--heads",
        "2",
        "--resolution",
        "64",
        "--steps",
        "20",
        "--rounds",
        "1",
        "--threads",
        "1",
    ]
    done = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    table = done.stdout
    rows = {m.group(1): m.groups()[1:] for m in re.finditer(r"\| (diffusers \+ FasterCache hook|diffserve fastercache) "
                                                             r"\| [\d.]+ \| [^|]+ \| (\d+) / 20 \| (\d+) / (\d+) \|", table)}  # fmt: skip
    assert set(rows) == {"diffusers + FasterCache hook", "diffserve fastercache"}, table
    hook, ours = rows["diffusers + FasterCache hook"], rows["diffserve fastercache"]
    assert hook == ours and int(ours[0]) > 0 and int(ours[1]) < int(ours[2]), table
    # the same pixels but for rounding (the exact images of the two differ by as much)
    assert re.search(r"cached images (identical|[\d.]+ dB apart, max 1 level)", table), table
