"""`diffserve make-tiny FAMILY DIR`: write a small random-weight checkpoint in Diffusers layout. The
registry (it imports torch) is read only when make-tiny runs or shows its help."""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from diffserve.errors import UserError

logger = logging.getLogger("diffserve")

#: How many of a non-empty folder's entries the refusal names.
_SHOWN_ENTRIES = 5


class _FamilyNames:
    """argparse `choices` asking the registry when used: names and aliases are accepted, names listed."""

    def __contains__(self, name: object) -> bool:
        from diffserve.errors import UserError
        from diffserve.registry import tiny_builder_by_name

        try:
            return isinstance(name, str) and tiny_builder_by_name(name) is not None
        except UserError:
            return False

    def __iter__(self) -> Iterator[str]:
        from diffserve.registry import tiny_target_names

        return iter(tiny_target_names())


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "make-tiny",
        help="write a tiny random-weight checkpoint (for tests and trying the engine)",
        description="Write a small random-weight checkpoint in Diffusers layout; draws noise, not pictures.",
    )
    add = p.add_argument
    add(
        "family",
        choices=_FamilyNames(),
        metavar="FAMILY",
        help="model family, or an add-on model of one (a ControlNet): %(choices)s",
    )
    add(
        "output_dir",
        help="folder to write (created if missing; an existing one must be empty, unless --force)",
    )
    add("--force", action="store_true",
        help="write into a folder that is not empty, replacing the files of the same name (a model folder's weights)")  # fmt: skip
    add("--seed", type=int, default=0, help="weight initialisation seed")
    add(
        "--no-guidance-embeds", action="store_true", help="FLUX.1: a schnell-style DiT, no guidance embedding"
    )
    add("--sd35", action="store_true", help="SD3: the SD3.5 layout (qk RMSNorm, dual attention in block 0)")
    add("--scheduler", choices=("flow-match-euler", "unipc"), default="flow-match-euler",
        help="wan-*: the scheduler written (unipc is what the released Wan 2.1 checkpoints ship)")  # fmt: skip
    add("--wan-variant", choices=("2.1", "2.2-a14b", "2.2-ti2v"), default="2.1",
        help="wan-*: Wan 2.2 A14B (two experts) or TI2V-5B (Wan 2.2 VAE; T2V and I2V, build it as the text-to-video family)")  # fmt: skip
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from diffserve.registry import TinyCheckpointOptions, tiny_builder_by_name

    builder = tiny_builder_by_name(args.family)
    if not args.force:
        refuse_non_empty_folder(Path(args.output_dir))
    options = TinyCheckpointOptions(
        args.seed, not args.no_guidance_embeds, args.sd35, args.scheduler, wan_variant=args.wan_variant
    )
    before = _file_states(Path(args.output_dir))
    path = builder(Path(args.output_dir), options)
    for file, state in _file_states(path).items():
        if before.get(file) != state:  # written now (a file of the folder --force wrote into keeps its mode)
            give_umask_mode(file)
    logger.info("Wrote tiny %s checkpoint to %s", args.family, path)
    return 0


def refuse_non_empty_folder(folder: Path) -> None:
    """A `UserError` naming what is in `folder` when it exists and is not empty (or is not a folder): the
    builders write over a model folder's weights and config, so another checkpoint there would be lost."""
    if not folder.exists() and not folder.is_symlink():
        return
    if not folder.is_dir():
        raise UserError(f"{str(folder)!r} exists and is not a folder; pass a new or empty folder")
    try:
        entries = sorted(entry.name for entry in folder.iterdir())
    except OSError as exc:
        raise UserError(f"{str(folder)!r} cannot be read: {exc.strerror or exc}") from None
    if not entries:
        return
    shown = ", ".join(entries[:_SHOWN_ENTRIES])
    if len(entries) > _SHOWN_ENTRIES:
        shown += f", ... ({len(entries)} entries)"
    pipeline = _pipeline_class(folder)
    what = f"a {pipeline} model folder ({shown})" if pipeline else shown
    raise UserError(
        f"{str(folder)!r} is not empty: it holds {what}; pass a new or empty folder, or --force to write over it"
    )


def _pipeline_class(folder: Path) -> str | None:
    """The pipeline class `folder`'s model_index.json names ("Diffusers" if none), None without that file."""
    index = folder / "model_index.json"
    if not index.is_file():
        return None
    try:
        name = json.loads(index.read_text(encoding="utf-8")).get("_class_name")
    except (OSError, ValueError, AttributeError):
        name = None
    return name if isinstance(name, str) and name else "Diffusers"


def _file_states(root: Path) -> dict[Path, tuple[int, int, int]]:
    """Every file under `root` -> (inode, size, mtime in ns): what tells a file written since apart."""
    states = {}
    for path in root.rglob("*") if root.is_dir() else ():
        if path.is_file() and not path.is_symlink():
            stat = path.stat()
            states[path] = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
    return states


def give_umask_mode(path: Path) -> None:
    """Give `path` the mode a plain `open()` would (0666 less the umask): safetensors writes its files 0600,
    which leaves a checkpoint or LoRA made for a shared server unreadable by its service user."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)
