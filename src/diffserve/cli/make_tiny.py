"""`diffserve make-tiny FAMILY DIR`: write a small random-weight checkpoint in Diffusers layout."""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger("diffserve")

FAMILIES = ("flux", "sd3", "qwen-image", "qwen-image-edit", "qwen-image-edit-plus", "zimage", "wan-t2v", "wan-i2v")

#: Qwen-Image families and the builder variant each writes.
_QWEN_IMAGE_VARIANTS = {"qwen-image": "t2i", "qwen-image-edit": "edit", "qwen-image-edit-plus": "edit_plus"}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "make-tiny",
        help="write a tiny random-weight checkpoint (for tests and trying the engine)",
        description="Write a small random-weight checkpoint in Diffusers layout; draws noise, not pictures.",
    )
    p.add_argument("family", choices=FAMILIES, help="model family")
    p.add_argument("output_dir", help="folder to write (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    p.add_argument(
        "--no-guidance-embeds", action="store_true", help="flux: FLUX.1-schnell style, no guidance embedding"
    )
    p.add_argument(
        "--sd35", action="store_true", help="sd3: SD3.5 style (qk RMSNorm, dual attention in block 0)"
    )
    p.add_argument(
        "--scheduler", choices=("flow-match-euler", "unipc"), default="flow-match-euler",
        help="wan-*: the scheduler written (unipc is what the released Wan 2.1 checkpoints ship)",
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.family == "sd3":
        from diffserve.testing.tiny_sd3 import TinySD3Spec, build_tiny_sd3

        spec = TinySD3Spec(seed=args.seed)
        if args.sd35:
            spec = TinySD3Spec(seed=args.seed, qk_norm="rms_norm", dual_attention_layers=(0,))
        path = build_tiny_sd3(args.output_dir, spec)
    elif args.family in _QWEN_IMAGE_VARIANTS:
        from diffserve.testing.tiny_qwen_image import TinyQwenImageSpec, build_tiny_qwen_image

        spec = TinyQwenImageSpec(variant=_QWEN_IMAGE_VARIANTS[args.family], seed=args.seed)
        path = build_tiny_qwen_image(args.output_dir, spec)
    elif args.family in ("wan-t2v", "wan-i2v"):
        from diffserve.testing.tiny_wan import TinyWanSpec, build_tiny_wan

        spec = TinyWanSpec(image_to_video=args.family == "wan-i2v", scheduler=args.scheduler, seed=args.seed)
        path = build_tiny_wan(args.output_dir, spec)
    elif args.family == "zimage":
        from diffserve.testing.tiny_zimage import TinyZImageSpec, build_tiny_zimage

        path = build_tiny_zimage(args.output_dir, TinyZImageSpec(seed=args.seed))
    else:
        from diffserve.testing.tiny_flux import TinyFluxSpec, build_tiny_flux

        path = build_tiny_flux(
            args.output_dir, TinyFluxSpec(seed=args.seed, guidance_embeds=not args.no_guidance_embeds)
        )
    logger.info("Wrote tiny %s checkpoint to %s", args.family, path)
    return 0
