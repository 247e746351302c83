"""Issue 30: docs/architecture.md's "A request's path" lists the files a request runs as the calls really go.

- The page's counts agree with its own table and model-code list (the bold summary line, the kinds, the
  `generate_many` paragraph): no walk, instant.
- The in-process walk: `tools/walk_request_path.py --path generate --json` in a subprocess (`diffserve
  generate` on a tiny FLUX.1, 32x32, 2 steps, recorded from `DiffGenerator.generate_many` to the return of
  the CLI's `run`; about 5 s, most of it importing torch) finds exactly the files the page lists for that
  path (the table rows the `generate_many` paragraph names, the files it adds, the model code), and the
  model code in the page's order. A file that now runs and is not on the page, or is on the page and no
  longer runs, fails here, named, until the page is walked again (`python tools/walk_request_path.py`).
- The server walk (both processes of `diffserve serve`, every row of the table) starts a server and its
  engine process (two imports of torch): about 15 s on an idle 2-core machine, 25-40 s beside other
  work. Too slow for every run, so it is checked only with `DIFFSERVE_TEST_SERVER_WALK=1` and skipped
  otherwise. The table's server-only rows (the front end, the engine process's transport) are
  checked by that test alone.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "architecture.md"
TOOL = REPO / "tools" / "walk_request_path.py"
SECTION = "## A request's path: `POST /v1/images/generations` to PNG bytes"
ROW = re.compile(r"^\| (\d+) \| `([^`]+)` \| (step|helper|untouched) \|", re.MULTILINE)
PY_FILE = re.compile(r"`([\w/]+\.py)`")


@dataclass
class PagePath:
    """What the page says: the table's rows, the model code, and its counts."""

    rows: list[tuple[int, str, str]]  # (number, file, kind), in table order
    model: list[str]
    text: str  # the section, whitespace folded to single spaces

    @property
    def files(self) -> dict[int, str]:
        return {number: file for number, file, _ in self.rows}


def page_path() -> PagePath:
    text = PAGE.read_text(encoding="utf-8")
    assert SECTION in text, f"{PAGE.name} has no section {SECTION!r}"
    section = text[text.index(SECTION) :]
    following = section.find("\n## ", len(SECTION))
    section = section if following < 0 else section[:following]
    rows = [(int(n), file, kind) for n, file, kind in ROW.findall(section)]
    folded = " ".join(section.split())
    listed = re.search(r"The model code, in order of first call \((\d+) files\): (.*?) The CLIP", folded)
    assert listed, "the section has no 'The model code, in order of first call (N files): ...' list"
    # Backticked .py names inside parentheses there are remarks, not list entries (none name a file today).
    model = PY_FILE.findall(re.sub(r"\([^()]*\)", "", listed.group(2)))
    assert int(listed.group(1)) == len(model), (
        f"the model-code list says {listed.group(1)} files and names {len(model)}: {model}"
    )
    return PagePath(rows, model, folded)


def row_numbers(spec: str) -> list[int]:
    """'8, 12 and 17-54' -> [8, 12, 17, ..., 54]."""
    numbers: list[int] = []
    for part in re.split(r",\s*|\s+and\s+", spec.strip()):
        first, _, last = part.partition("-")
        numbers.extend(range(int(first), int(last or first) + 1))
    return numbers


def generate_files(page: PagePath) -> tuple[set[str], int, int, int]:
    """The files the page lists for the `generate_many` path, and the counts its paragraph gives
    (all, control, model)."""
    said = re.search(
        r"(\d+) files from `generate_many` to the written PNG: (\d+) of control code "
        r"\(rows ([\d,\- and]+?), plus (.*?)\) and the same (\d+) of model code",
        page.text,
    )
    assert said, "the generate_many paragraph has no 'N files from `generate_many` ...: C of control code "
    "(rows ..., plus ...) and the same M of model code' sentence"
    numbers = row_numbers(said.group(3))
    unknown = [n for n in numbers if n not in page.files]
    assert not unknown, f"the generate_many paragraph names rows the table lacks: {unknown}"
    control = {page.files[n] for n in numbers} | set(PY_FILE.findall(said.group(4)))
    total, n_control, n_model = int(said.group(1)), int(said.group(2)), int(said.group(5))
    return control | set(page.model), total, n_control, n_model


def walk(path: str) -> dict:
    done = subprocess.run(
        [sys.executable, str(TOOL), "--path", path, "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{TOOL.name} --path {path} failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout[done.stdout.index("{") :])


def differences(walked: list[str], listed: set[str], what: str) -> str:
    missing = [file for file in walked if file not in listed]
    stale = sorted(listed - set(walked))
    lines = [
        f"docs/architecture.md's {what} is not what the walk finds ({len(walked)} files run, {len(listed)} listed)."
    ]
    if missing:
        lines.append(f"Run but not on the page: {', '.join(missing)}")
    if stale:
        lines.append(f"On the page but not run: {', '.join(stale)}")
    lines.append("Walk it again (python tools/walk_request_path.py) and update the section and its counts.")
    return "\n".join(lines)


def test_the_page_counts_agree() -> None:
    page = page_path()
    numbers = [n for n, _, _ in page.rows]
    assert numbers == list(range(len(numbers))), f"the table's rows are not numbered 0..N-1: {numbers}"
    files = [file for _, file, _ in page.rows]
    assert len(set(files)) == len(files), "a file has two rows"
    assert not set(files) & set(page.model), "a file is both a row and model code"
    summary = re.search(
        r"\*\*(\d+) files run: (\d+) of control code \(below\) and (\d+) of model code", page.text
    )
    assert summary, "no bold '**N files run: C of control code (below) and M of model code' line"
    total, control, model = map(int, summary.groups())
    assert (control, model, total) == (len(page.rows), len(page.model), len(page.rows) + len(page.model)), (
        f"the bold line says {total} = {control} + {model}; the table has {len(page.rows)} rows and the "
        f"model list {len(page.model)} files"
    )
    kinds = re.search(
        r"Of the (\d+), (\d+) are steps .*?, (\d+) are shared helpers .*?, and (\d+) are files this request "
        r"passes through untouched",
        page.text,
    )
    assert kinds, "no 'Of the C, S are steps ..., H are shared helpers ..., and U are files ... untouched'"
    counted = {kind: sum(k == kind for _, _, k in page.rows) for kind in ("step", "helper", "untouched")}
    said = dict(zip(("step", "helper", "untouched"), map(int, kinds.groups()[1:]), strict=True))
    assert int(kinds.group(1)) == len(page.rows) and said == counted, (
        f"the kinds line says {kinds.group(0)!r}; the table has {counted}"
    )
    listed, total, control, model = generate_files(page)
    assert (total, model) == (len(listed), len(page.model)) and control == total - model, (
        f"the generate_many paragraph says {total} files, {control} control and {model} model; it lists "
        f"{len(listed) - len(page.model)} control and {len(page.model)} model files"
    )


def test_generate_walk_matches_the_page() -> None:
    page = page_path()
    listed = generate_files(page)[0]
    walked = [call["file"] for call in walk("generate")["generate"]]
    assert set(walked) == listed, differences(walked, listed, "generate_many path")
    order = [file for file in walked if file in set(page.model)]
    assert order == page.model, (
        f"the model code is not listed in the order of its first call; the walk's order: {', '.join(order)}"
    )


@pytest.mark.skipif(
    os.environ.get("DIFFSERVE_TEST_SERVER_WALK") != "1",
    reason="starts a server (15-40 s): set DIFFSERVE_TEST_SERVER_WALK=1 to check the table's server rows",
)
def test_server_walk_matches_the_page() -> None:
    page = page_path()
    listed = set(page.files.values()) | set(page.model)
    walked = [call["file"] for call in walk("server")["server"]]
    assert set(walked) == listed, differences(walked, listed, "server path (table and model code)")
