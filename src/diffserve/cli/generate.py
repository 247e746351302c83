"""`diffserve generate`: one or more prompts through a model folder, images written to disk."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import tempfile
import time
from dataclasses import fields
from pathlib import Path

from diffserve.cli.controlnet_flags import add_controlnet_flags, controlnet_choices_from, with_control_inputs
from diffserve.cli.engine_flags import add_engine_flags, engine_args_from
from diffserve.cli.lora_flags import lora_choices_from
from diffserve.configs.cache_settings import cache_from_flag
from diffserve.configs.option import add_option, add_options, option_of
from diffserve.configs.sampling_params import SamplingParams, extra_from_flag
from diffserve.errors import InvalidRequestError, UserError
from diffserve.video_inputs import MAX_INPUT_VIDEO_FRAMES

logger = logging.getLogger("diffserve")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate images from a prompt",
        description="Generate images with a Diffusers-format model folder.",
    )
    add_engine_flags(p, "generate")
    add = p.add_argument
    prompt = p.add_mutually_exclusive_group(required=True)
    add_option(prompt, option_of(SamplingParams, "prompt"))
    prompt.add_argument("--prompt-file", help="file with one prompt per line (blank lines skipped)")
    add("--image", action="append", default=None, metavar="PATH",
        help="input image of an edit model (repeat for several, in order), or the start image of image-to-image "
        "(FLUX, SD3); png, jpeg, webp, bmp or gif")  # fmt: skip
    add("--video", default=None, metavar="PATH",
        help="the video to extend (video-to-video folders: SkyReels-V2 diffusion forcing's extension, with "
        "--extra '{\"overlap_history\": 17}'); mp4, mov, webm, gif or webp, at most "
        f"{MAX_INPUT_VIDEO_FRAMES} frames")  # fmt: skip
    add("--mask", default=None, metavar="PATH",
        help="inpainting mask of the --image's size: transparent pixels (alpha 0) or, without alpha, white "
        "pixels mark the area to repaint (FLUX, SD3 and FLUX.1 Fill folders)")  # fmt: skip
    # The SamplingParams flags, unchecked here: `check_params` reports a bad value naming the flag.
    add_options(p, SamplingParams, "generate", skip=("prompt",))
    add_controlnet_flags(p)
    add("--save-frames", action="store_true", help="video models: also write every frame as a PNG")
    add("--output-file-name", default=None, help="file name instead of the generated one")
    add("--save-output", action=argparse.BooleanOptionalAction, default=True,
        help="write images to --output-path")  # fmt: skip
    p.set_defaults(handler=run)


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    path = Path(args.prompt_file)
    if not path.is_file():
        raise UserError(f"--prompt-file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"--prompt-file {str(path)!r} is not UTF-8 text (byte {exc.start}: {exc.reason}); save it as UTF-8"
        ) from None
    except OSError as exc:
        raise UserError(f"--prompt-file {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UserError(f"--prompt-file {str(path)!r} has no prompts")
    return prompts


def check_output_path(text: str) -> None:
    """Refuse an --output-path that is a file or cannot be created or written, before any model work: the
    folders missing are created and a file is written there (both removed again), as permissions alone do
    not tell (root passes every permission check, yet /proc takes no new folder)."""
    path = Path(os.path.abspath(text))  # ".." folded, so that the folders missing are real ones
    if path.exists() and not path.is_dir():
        raise UserError(f"--output-path {text!r} is a file; pass a directory (it is created when missing)")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"--output-path {text!r} cannot be created: {str(existing)!r} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == path else f" ({str(existing)!r}, where it would be created, is not)"
        raise UserError(f"--output-path {text!r} is not writable{where}; pass a directory you can write to")
    missing = [path, *path.parents][: len(path.parts) - len(existing.parts)]
    created: list[Path] = []
    try:
        for folder in reversed(missing):
            folder.mkdir()
            created.append(folder)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".diffserve-write-check-"):
            pass
    except OSError as exc:
        what = "created" if len(created) < len(missing) else "written"
        raise UserError(
            f"--output-path {text!r} cannot be {what}: {exc.strerror or exc}; pass a directory you can write to"
        ) from None
    finally:
        for folder in reversed(created):
            with contextlib.suppress(OSError):
                folder.rmdir()


def kept_elsewhere(outputs: list, output_path: str) -> list[str]:
    """The output files that were written outside `output_path` (kept in a temporary folder by
    `write_outputs` when the folder could not be written at the end)."""
    target = Path(output_path).absolute()
    return [path for out in outputs for path in out.output_paths if Path(path).absolute().parent != target]


def check_params(params: SamplingParams, max_inference_steps: int) -> None:
    """The checks that need no model, as errors naming the flag (the model's own limits come later)."""
    from diffserve.runtime.engine import check_step_limit

    try:
        params.check_values()
        check_step_limit(max_inference_steps, params.num_inference_steps)
    except InvalidRequestError as exc:
        if exc.param is None:
            raise
        raise UserError(f"--{exc.param.replace('_', '-')}: {exc}") from None


def seed_or_random(seed: int | None) -> int:
    """`--seed` as given, or a random seed when none was, logged so that the run can be repeated (as the
    server and diffusers do; one seed for all the prompts of a run, as an explicit `--seed` is)."""
    if seed is not None:
        return seed
    drawn = secrets.randbelow(2**32)
    logger.info("No --seed given: using the random seed %d (pass --seed %d to repeat this run)", drawn, drawn)
    return drawn


def run(args: argparse.Namespace) -> int:
    from diffserve.api import DiffGenerator, serve_rank
    from diffserve.distributed.launch import is_follower, run_follower
    from diffserve.image_inputs import load_images
    from diffserve.video_inputs import VideoInputLimits, load_video

    start = time.perf_counter()
    engine_args = engine_args_from(args)
    if is_follower(engine_args.parallel_config()):  # torchrun rank > 0, or --node-rank > 0
        run_follower(engine_args, serve_rank)
        return 0
    prompts = _read_prompts(args)
    # Every flag named as a SamplingParams field (but the prompt) is that field.
    flags = {f.name: getattr(args, f.name) for f in fields(SamplingParams) if f.name in vars(args)}
    flags.pop("prompt")
    flags["loras"] = lora_choices_from(args)  # --lora: loaded at start (engine_args), applied here
    # --controlnet is loaded at start (engine_args); --control-image and its flags apply it here.
    flags["controlnets"] = controlnet_choices_from(args)
    if flags["controlnets"]:
        flags["controlnets"] = [with_control_inputs(flags["controlnets"][0], args)]
    if flags.get("cache") is not None:  # its errors name the flag
        flags["cache"] = cache_from_flag(flags["cache"], "--cache")
    extra = flags.pop("extra", None)  # unset: no family settings
    if extra is not None:
        flags["extra"] = extra_from_flag(extra, "--extra")
    # Checked before loading the model: a bad flag or path fails in a second, not after the weights load
    # (no --seed: any valid seed stands in for the random one drawn once the checks have passed).
    checked = {**flags, "seed": 0 if args.seed is None else args.seed}
    for prompt in prompts:
        check_params(SamplingParams(prompt=prompt, **checked), args.max_inference_steps)
    if args.save_output:
        check_output_path(args.output_path)
    # Paths only: a string that is not an existing file is an error, never a URL download.
    # Transparency kept: the family's validation drops it unless it reads alpha (Qwen-Image-Layered).
    images = (
        load_images([Path(p) for p in args.image], param="--image", keep_alpha=True) if args.image else None
    )
    mask = load_images(Path(args.mask), param="--mask", as_mask=True)[0] if args.mask else None
    video = load_video(Path(args.video), param="--video", limits=VideoInputLimits()) if args.video else None
    flags["seed"] = seed_or_random(args.seed)
    params_list = [
        SamplingParams(prompt=p, input_images=images, mask_image=mask, input_video=video, **flags)
        for p in prompts
    ]
    with DiffGenerator(engine_args) as generator:  # with --num-gpus > 1 its exit stops the other ranks
        if len(params_list) > 1:
            logger.info("Processing %d prompts together (their steps share DiT batches)", len(params_list))
        outputs = generator.generate_many(  # validates every prompt before any model work
            params_list,
            args.save_output,
            args.output_path,
            args.output_file_name,
            save_frames=args.save_frames,
        )
    kept = kept_elsewhere(outputs, args.output_path) if args.save_output else []
    if kept:
        raise UserError(
            f"--output-path {args.output_path!r} could not be written when the work was done; the outputs were "
            f"kept in {Path(kept[0]).parent} instead: {', '.join(Path(path).name for path in kept)}"
        )
    peaks = [out.peak_memory_mb for out in outputs if out.peak_memory_mb is not None]
    n_images = len(params_list) * args.num_outputs_per_prompt
    kind = "video(s)" if generator.family.task.endswith("video") else "image(s)"
    logger.info("Completed: generated %d %s in %.2f seconds", n_images, kind, time.perf_counter() - start)
    if peaks:
        from diffserve.offload import log_resident_candidates

        logger.info("Memory usage - max peak: %.2f MB", max(peaks))
        log_resident_candidates(generator.pipeline.context.components, generator.platform, max(peaks) * 2**20)
    return 0
