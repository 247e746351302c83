"""diffserve nodes for ComfyUI: generate, edit and make videos on a running diffserve server over HTTP.

Install: copy or symlink this folder into ComfyUI's `custom_nodes/` (README.md). The nodes speak the
server's OpenAI-compatible routes with the standard library; they never import diffserve, so ComfyUI's
environment needs nothing beyond what it has (torch, numpy, Pillow, PyAV).
"""

from .nodes import DiffserveControlNet, DiffserveEdit, DiffserveGenerate, DiffserveLoras, DiffserveVideo

NODE_CLASS_MAPPINGS = {
    "DiffserveGenerate": DiffserveGenerate,
    "DiffserveEdit": DiffserveEdit,
    "DiffserveVideo": DiffserveVideo,
    "DiffserveLoras": DiffserveLoras,
    "DiffserveControlNet": DiffserveControlNet,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "DiffserveGenerate": "diffserve Generate (text to image)",
    "DiffserveEdit": "diffserve Edit (image + mask)",
    "DiffserveVideo": "diffserve Video",
    "DiffserveLoras": "diffserve LoRAs",
    "DiffserveControlNet": "diffserve ControlNet",
}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
