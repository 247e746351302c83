"""The request part of a command line the CLI tests share (`diffserve generate`, `diffserve
calibrate-cache`): the prompt, the size and the step count, in the order a user types them."""

from __future__ import annotations


def request_args(
    prompt: str | None = None, height: int = 32, width: int = 32, steps: int | None = None
) -> list[str]:
    """`--prompt PROMPT --height H --width W --num-inference-steps STEPS`, without `--prompt` when `prompt`
    is None (the test passes a prompt file, or a prompt of its own later) and without the step count when
    `steps` is None (the command's default)."""
    args = [] if prompt is None else ["--prompt", prompt]
    args += ["--height", str(height), "--width", str(width)]
    if steps is not None:
        args += ["--num-inference-steps", str(steps)]
    return args
