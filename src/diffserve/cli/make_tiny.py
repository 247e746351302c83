"""`diffserve make-tiny FAMILY DIR`: write a small random-weight checkpoint in Diffusers layout.

The families and their builders are the registry's (`diffserve.registry`). The registry imports torch
and every pipeline, and the `diffserve` command line must stay free of torch (the server's HTTP process
builds this parser too), so the family names are read from it only when make-tiny itself runs or shows
its help.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger("diffserve")


class _FamilyNames:
    """argparse `choices` that ask the registry when first used: a family's name or alias is accepted,
    and the names (without aliases) are what help and errors list."""

    def __contains__(self, name: object) -> bool:
        from diffserve.errors import UserError
        from diffserve.registry import family_by_name

        if not isinstance(name, str):
            return False
        try:
            family_by_name(name)
        except UserError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        from diffserve.registry import family_names

        return iter(family_names())


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "make-tiny",
        help="write a tiny random-weight checkpoint (for tests and trying the engine)",
        description="Write a small random-weight checkpoint in Diffusers layout; draws noise, not pictures.",
    )
    p.add_argument("family", choices=_FamilyNames(), metavar="FAMILY", help="model family: %(choices)s")
    p.add_argument("output_dir", help="folder to write (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    p.add_argument(
        "--no-guidance-embeds", action="store_true", help="flux: FLUX.1-schnell style, no guidance embedding"
    )
    p.add_argument(
        "--sd35", action="store_true", help="sd3: SD3.5 style (qk RMSNorm, dual attention in block 0)"
    )
    p.add_argument(
        "--scheduler",
        choices=("flow-match-euler", "unipc"),
        default="flow-match-euler",
        help="wan-*: the scheduler written (unipc is what the released Wan 2.1 checkpoints ship)",
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from diffserve.registry import TinyCheckpointOptions, family_by_name

    family = family_by_name(args.family)
    options = TinyCheckpointOptions(
        seed=args.seed, guidance_embeds=not args.no_guidance_embeds, sd35=args.sd35, scheduler=args.scheduler
    )
    path = family.tiny_builder(Path(args.output_dir), options)
    logger.info("Wrote tiny %s checkpoint to %s", family.name, path)
    return 0
