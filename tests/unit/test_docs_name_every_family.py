"""Issue 31 item 7: where a reader looks for the list of families, every registered family is named.

- The README's status line (the paragraph between the `<!-- family-status -->` and
  `<!-- /family-status -->` markers) names each family by its registry name in backticks.
- The README's `make-tiny` example (the `diffserve make-tiny flux` line and the `#` comment lines right
  after it) names each family, as does `diffserve make-tiny --help`.
- pyproject.toml's `description` names each family package (a label per package, below).

The names come from `diffserve.registry.FAMILIES`, so a family added to the registry fails here until
the README and the description say so. The docs pages that describe the code (docs/architecture.md,
docs/adding-a-model.md) and the README name only source files that exist.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from diffserve.cli.main import main
from diffserve.registry import FAMILIES

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
STATUS_BEGIN, STATUS_END = "<!-- family-status -->", "<!-- /family-status -->"
MAKE_TINY_LINE = re.compile(r"^.*\bdiffserve make-tiny flux(?![\w-]).*$")
DESCRIPTION = re.compile(r'^description\s*=\s*"(?P<text>[^"]*)"\s*$', re.MULTILINE)
#: How pyproject.toml's description names each family package (`families/<package>/`).
PACKAGE_LABELS = {
    "flux": "FLUX.1",
    "flux2": "FLUX.2",
    "sd3": "SD3",
    "qwen_image": "Qwen-Image",
    "z_image": "Z-Image",
    "chroma": "Chroma",
    "sana": "SANA",
    "sana_video": "SANA-Video",
    "wan": "Wan",
    "cogvideox": "CogVideoX",
    "hunyuan_video15": "HunyuanVideo 1.5",
    "ltx2": "LTX-2",
    "longcat_image": "LongCat-Image",
    "mochi": "Mochi",
    "hidream": "HiDream-I1",
    "hunyuan_video": "HunyuanVideo 1.0",
    "qwen_image21": "Qwen-Image 2.1",
    "hunyuan_image": "HunyuanImage 2.1",
}
#: The pages whose `*.py` mentions must name files of the tree.
PAGES_NAMING_FILES = (README, REPO / "docs" / "architecture.md", REPO / "docs" / "adding-a-model.md")

NAMES = [family.name for family in FAMILIES]


def names_in(text: str) -> set[str]:
    """The family names `text` mentions as whole names (`flux` is not found inside `flux-fill`)."""
    return {name for name in NAMES if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)}


def status_paragraph(readme: str) -> str:
    """The README's text between the status markers (each must be there exactly once)."""
    for marker in (STATUS_BEGIN, STATUS_END):
        assert readme.count(marker) == 1, f"README.md must have {marker} exactly once"
    text = readme.split(STATUS_BEGIN)[1].split(STATUS_END)[0]
    assert text.strip().startswith("Status:"), "the status markers must surround the Status: paragraph"
    return text


def make_tiny_list(readme: str) -> str:
    """The `diffserve make-tiny flux` line of the README and the `#` comment lines right after it."""
    lines = readme.splitlines()
    starts = [i for i, line in enumerate(lines) if MAKE_TINY_LINE.match(line)]
    assert len(starts) == 1, f"README.md must have one `diffserve make-tiny flux` line, has {len(starts)}"
    listed = [lines[starts[0]]]
    for line in lines[starts[0] + 1 :]:
        if not line.lstrip().startswith("#"):
            break
        listed.append(line)
    assert len(listed) > 1, "the `diffserve make-tiny flux` line must be followed by its `# also:` list"
    return "\n".join(listed)


def package_of(family_module: str) -> str:
    return family_module.split(".")[2]  # diffserve.families.<package>.pipeline


def test_the_readme_status_line_names_every_family() -> None:
    text = status_paragraph(README.read_text())
    coded = set(re.findall(r"`([^`]+)`", text))
    missing = [name for name in NAMES if name not in coded]
    assert not missing, f"README.md's status line does not name these families (as `name`): {missing}"


def test_the_readme_make_tiny_list_names_every_family() -> None:
    missing = sorted(set(NAMES) - names_in(make_tiny_list(README.read_text())))
    assert not missing, f"README.md's make-tiny list (`# also:` under `make-tiny flux`) misses: {missing}"


def test_make_tiny_help_names_every_family(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # argparse would wrap, and may break a name at its hyphen
    with pytest.raises(SystemExit) as exited:
        main(["make-tiny", "--help"])
    assert exited.value.code == 0
    missing = sorted(set(NAMES) - names_in(capsys.readouterr().out))
    assert not missing, f"`diffserve make-tiny --help` does not offer: {missing}"


def test_the_package_description_names_every_family_package() -> None:
    packages = {package_of(family.pipeline_cls.__module__) for family in FAMILIES}
    assert packages == set(PACKAGE_LABELS), (
        f"family packages {sorted(packages)} != the labels' {sorted(PACKAGE_LABELS)}: give a new package "
        "its label in PACKAGE_LABELS and name it in pyproject.toml's description and README.md's status line"
    )
    found = DESCRIPTION.search((REPO / "pyproject.toml").read_text())
    assert found is not None, "pyproject.toml has no one-line description"
    description = found["text"]
    missing = [label for package, label in PACKAGE_LABELS.items() if label not in description]
    assert not missing, f"pyproject.toml's description does not name: {missing}"


def test_the_checks_find_a_missing_family() -> None:
    readme = (
        "intro\n\n<!-- family-status -->\n\nStatus: **FLUX.1** (`flux`, `flux-fill`) run.\n\n"
        "<!-- /family-status -->\n\n```bash\n.venv/bin/diffserve make-tiny flux /tmp/f\n# also: flux-fill, sana\n"
        "diffserve generate\n```\n"
    )
    assert set(re.findall(r"`([^`]+)`", status_paragraph(readme))) == {"flux", "flux-fill"}
    listed = make_tiny_list(readme)
    assert "generate" not in listed
    assert names_in(listed) == {"flux", "flux-fill", "sana"}  # not flux-kontext, not sana-sprint


def source_files() -> list[str]:
    """The repository's tracked and untracked (not ignored) Python files, relative to its root."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return out.stdout.split()


@pytest.mark.parametrize("page", PAGES_NAMING_FILES, ids=lambda page: page.name)
def test_the_pages_name_only_files_that_exist(page: Path) -> None:
    """Every `something.py` the page names is a file of the tree: a path from the repository root, from
    `src/diffserve/`, or the tail of one (`flux/pipeline.py`). Templates (`families/<name>/record.py`,
    `server/*_routes.py`) are not checked."""
    files = source_files()
    if not files:
        pytest.skip("not a git checkout")
    mentioned = set(re.findall(r"(?<![\w./<>*-])([\w./<>*-]*\w\.py)\b", page.read_text()))
    stale = sorted(
        name
        for name in mentioned
        if "<" not in name and "*" not in name and not any(f == name or f.endswith("/" + name) for f in files)
    )
    assert not stale, f"{page.name} names files that are not in the tree: {stale}"
