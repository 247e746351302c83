"""`diffserve make-lora OUT.safetensors`: write a random LoRA file for a model folder's DiT, in the
diffusers/PEFT layout, so the LoRA flags and routes can be tried without downloading an adapter (as
`make-tiny` does for checkpoints). torch is imported only when the command runs."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from diffserve.cli.make_tiny import give_umask_mode
from diffserve.errors import UserError

logger = logging.getLogger("diffserve")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "make-lora",
        help="write a random LoRA file for a model folder's DiT (for tests and trying the LoRA routes)",
        description="Write a random-weight LoRA (diffusers/PEFT layout) on every Linear of the DiT's blocks; "
        "it changes the images, it does not teach a style.",
    )
    add = p.add_argument
    add("output_file", help="the .safetensors file to write (its folder is created if missing; not an existing "
        "file, unless --force)")  # fmt: skip
    add("--force", action="store_true", help="replace the output file if it exists")
    add("--model-path", default=None, help="Diffusers model folder (default: the shipped demo model)")
    add("--rank", type=int, default=4, help="LoRA rank (default 4)")
    add(
        "--alpha",
        type=float,
        default=None,
        help="LoRA alpha (default: none stored, which means alpha = rank)",
    )
    add("--seed", type=int, default=0, help="weight seed (default 0)")
    add("--std", type=float, default=0.1, help="standard deviation of both factors (default 0.1)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from diffserve.configs.demo_model import model_path_or_demo
    from diffserve.loader.model_index import read_model_index
    from diffserve.registry import DIT_FACTS
    from diffserve.testing.tiny_lora import DIT_CLASSES, write_random_lora

    if args.rank < 1:
        raise UserError(f"--rank must be a positive integer, got {args.rank}")
    if not args.output_file.endswith(".safetensors"):
        raise UserError(f"the output file must end in .safetensors, got {args.output_file!r}")
    out_file = Path(args.output_file)
    if out_file.is_dir():
        raise UserError(f"{args.output_file!r} is a folder; pass the path of the .safetensors file to write")
    if (out_file.exists() or out_file.is_symlink()) and not args.force:
        raise UserError(
            f"{args.output_file!r} exists ({_describe(out_file)}); pass a new file name, or --force to replace it"
        )
    model_path = model_path_or_demo(args.model_path)
    transformer = read_model_index(model_path).components.get("transformer")
    supported = set(DIT_FACTS.lora_classes()) & set(DIT_CLASSES)
    if transformer is None or transformer.class_name not in supported:
        found = transformer.class_name if transformer is not None else "no transformer"
        raise UserError(
            f"{model_path} has {found}; make-lora supports the native DiTs that take LoRA adapters: "
            f"{', '.join(sorted(supported))}"
        )
    out = write_random_lora(
        model_path, out_file, rank=args.rank, alpha=args.alpha, seed=args.seed, std=args.std
    )
    give_umask_mode(out)  # safetensors writes 0600; a file made with the user's umask, like any other
    logger.info("Wrote a random rank-%d LoRA for %s to %s", args.rank, transformer.class_name, out)
    return 0


def _describe(path: Path) -> str:
    """What an existing output file is, for the refusal: its size (or that it cannot be read)."""
    try:
        size = path.stat().st_size
    except OSError:
        return "a broken link" if path.is_symlink() else "unreadable"
    return f"{size:,} bytes" if size != 1 else "1 byte"
