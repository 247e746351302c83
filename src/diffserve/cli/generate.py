"""`diffserve generate`: one or more prompts through a model folder, images written to disk."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from diffserve.cli.engine_flags import add_engine_flags, engine_args_from
from diffserve.cli.logging_setup import LEVELS
from diffserve.errors import UserError

logger = logging.getLogger("diffserve")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate images from a prompt",
        description="Generate images with a Diffusers-format model folder.",
    )
    add_engine_flags(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text prompt")
    prompt.add_argument("--prompt-file", help="file with one prompt per line (blank lines skipped)")
    p.add_argument("--negative-prompt", default=None, help="negative prompt (used with --true-cfg-scale > 1)")
    p.add_argument("--height", type=int, default=None, help="image height in pixels (model default if unset)")
    p.add_argument("--width", type=int, default=None, help="image width in pixels (model default if unset)")
    p.add_argument("--num-inference-steps", type=int, default=None, help="denoising steps")
    p.add_argument("--guidance-scale", type=float, default=None, help="embedded guidance (FLUX.1-dev: 3.5)")
    p.add_argument("--true-cfg-scale", type=float, default=None, help="true CFG scale; >1 with a negative prompt")
    p.add_argument("--max-sequence-length", type=int, default=None, help="T5 tokens (FLUX: at most 512)")
    p.add_argument("--seed", type=int, default=0, help="noise seed (same seed, same image on every device)")
    p.add_argument("--num-outputs-per-prompt", type=int, default=1, help="images per prompt")
    p.add_argument("--output-path", default="outputs", help="directory for output files (default: outputs/)")
    p.add_argument("--output-file-name", default=None, help="file name instead of the generated one")
    p.add_argument(
        "--save-output", action=argparse.BooleanOptionalAction, default=True, help="write images to --output-path"
    )
    p.add_argument("--log-level", default="info", choices=LEVELS)
    p.set_defaults(handler=run)


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    path = Path(args.prompt_file)
    if not path.is_file():
        raise UserError(f"--prompt-file {str(path)!r} does not exist")
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise UserError(f"--prompt-file {str(path)!r} has no prompts")
    return prompts


def run(args: argparse.Namespace) -> int:
    from diffserve.api import DiffGenerator
    from diffserve.configs.sampling_params import SamplingParams

    start = time.perf_counter()
    prompts = _read_prompts(args)
    generator = DiffGenerator(engine_args_from(args))
    params_list = [
        SamplingParams(
            prompt=prompt,
            negative_prompt=args.negative_prompt,
            height=args.height,
            width=args.width,
            num_inference_steps=args.num_inference_steps,
            guidance_scale=args.guidance_scale,
            true_cfg_scale=args.true_cfg_scale,
            max_sequence_length=args.max_sequence_length,
            seed=args.seed,
            num_outputs_per_prompt=args.num_outputs_per_prompt,
        )
        for prompt in prompts
    ]
    for params in params_list:  # validate every prompt before spending time on the first
        generator.pipeline.resolve_params(params)
    peaks = []
    for i, params in enumerate(params_list, 1):
        logger.info("Processing prompt %d/%d: %s", i, len(params_list), params.prompt)
        out = generator.generate_from_params(
            params, save_output=args.save_output, output_path=args.output_path, file_name=args.output_file_name
        )
        if out.peak_memory_mb is not None:
            peaks.append(out.peak_memory_mb)
    n_images = len(params_list) * args.num_outputs_per_prompt
    logger.info("Completed: generated %d image(s) in %.2f seconds", n_images, time.perf_counter() - start)
    if peaks:
        logger.info("Memory usage - max peak: %.2f MB", max(peaks))
    return 0
