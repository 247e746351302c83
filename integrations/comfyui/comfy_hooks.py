"""ComfyUI's cancel button and progress bar, when the pack runs inside ComfyUI.

The pack must also import and run without ComfyUI (its tests, scripts): there nothing can cancel a run
and there is no bar to move, so the hooks do nothing. Which one applies is decided by whether ComfyUI's
`comfy` package is importable, once per node run.
"""

from __future__ import annotations

from collections.abc import Callable


def interrupt_check() -> Callable[[], None]:
    """A function that raises ComfyUI's interruption exception once the user cancelled the run."""
    try:
        from comfy import model_management
    except ImportError:  # outside ComfyUI
        return lambda: None
    return model_management.throw_exception_if_processing_interrupted


def progress_reporter(total: int) -> Callable[[int], None]:
    """A function that sets the node's progress bar to a value in 0..`total`."""
    try:
        from comfy.utils import ProgressBar
    except ImportError:  # outside ComfyUI
        return lambda value: None
    bar = ProgressBar(total)
    return lambda value: bar.update_absolute(value, total)
