"""`diffserve make-tiny FAMILY DIR`: write a small random-weight checkpoint in Diffusers layout. The
registry (it imports torch) is read only when make-tiny runs or shows its help."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger("diffserve")


class _FamilyNames:
    """argparse `choices` asking the registry when used: names and aliases are accepted, names listed."""

    def __contains__(self, name: object) -> bool:
        from diffserve.errors import UserError
        from diffserve.registry import family_by_name

        try:
            return isinstance(name, str) and family_by_name(name) is not None
        except UserError:
            return False

    def __iter__(self) -> Iterator[str]:
        from diffserve.registry import family_names

        return iter(family_names())


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "make-tiny",
        help="write a tiny random-weight checkpoint (for tests and trying the engine)",
        description="Write a small random-weight checkpoint in Diffusers layout; draws noise, not pictures.",
    )
    add = p.add_argument
    add("family", choices=_FamilyNames(), metavar="FAMILY", help="model family: %(choices)s")
    add("output_dir", help="folder to write (created if missing)")
    add("--seed", type=int, default=0, help="weight initialisation seed")
    add("--no-guidance-embeds", action="store_true", help="FLUX.1: a schnell-style DiT, no guidance embedding")
    add("--sd35", action="store_true", help="SD3: the SD3.5 layout (qk RMSNorm, dual attention in block 0)")
    add("--scheduler", choices=("flow-match-euler", "unipc"), default="flow-match-euler",
        help="wan-*: the scheduler written (unipc is what the released Wan 2.1 checkpoints ship)")  # fmt: skip
    add("--wan-variant", choices=("2.1", "2.2-a14b", "2.2-ti2v"), default="2.1",
        help="wan-*: Wan 2.2 A14B (two experts) or TI2V-5B (Wan 2.2 VAE; T2V and I2V, build it as the text-to-video family)")  # fmt: skip
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from diffserve.registry import TinyCheckpointOptions, family_by_name

    family = family_by_name(args.family)
    options = TinyCheckpointOptions(
        args.seed, not args.no_guidance_embeds, args.sd35, args.scheduler, wan_variant=args.wan_variant
    )
    path = family.tiny_builder(Path(args.output_dir), options)
    _apply_umask(path)
    logger.info("Wrote tiny %s checkpoint to %s", family.name, path)
    return 0


def _apply_umask(root: Path) -> None:
    """Give every written file the mode a plain `open()` would (0666 less the umask): safetensors writes its
    files 0600, which leaves a checkpoint made for a shared server unreadable by its service user."""
    umask = os.umask(0)
    os.umask(umask)
    for path in root.rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)
