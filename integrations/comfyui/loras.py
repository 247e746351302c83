"""LoRA selections: the text a user types ("ink:0.8, detail"), as the `loras` list requests send, checked
against what the server serves (`GET /v1/loras`, and its `--lora-dir` from `/server_info`)."""

from __future__ import annotations

import math
import re

from .client import DiffserveClient, DiffserveError

#: The value passed between nodes: the request field, a list of {"name": str, "scale": float}.
LoraList = list[dict]

_ENTRY = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?:\s*:\s*(?P<scale>\S+))?$")


def parse_selection(text: str) -> LoraList:
    """`text`'s entries, separated by commas or new lines: `NAME` (scale 1.0) or `NAME:SCALE`."""
    entries: LoraList = []
    for raw in re.split(r"[,\n]", text):
        item = raw.strip()
        if not item:
            continue
        match = _ENTRY.match(item)
        if match is None:
            raise ValueError(
                f"LoRA entry {item!r} is not NAME or NAME:SCALE (names: letters, digits, '.', '_', '-')"
            )
        scale = 1.0
        if match["scale"] is not None:
            try:
                scale = float(match["scale"])
            except ValueError:
                raise ValueError(f"LoRA entry {item!r}: scale {match['scale']!r} is not a number") from None
            if not math.isfinite(scale):
                raise ValueError(f"LoRA entry {item!r}: scale must be a finite number")
        entries.append({"name": match["name"], "scale": scale})
    return entries


def served_loras(client: DiffserveClient) -> list[str]:
    """The names of the adapters the server has loaded (`GET /v1/loras`)."""
    return [entry["name"] for entry in client.get_json("/v1/loras")["data"]]


def check_served(client: DiffserveClient, selection: LoraList, listed: list[str]) -> None:
    """DiffserveError naming the first selected adapter the server cannot apply: not `listed` and the
    server has no --lora-dir (with one, the server reads `NAME.safetensors` from it on first use, so
    only the request can tell)."""
    unknown = [entry["name"] for entry in selection if entry["name"] not in listed]
    if not unknown:
        return
    loras = client.get_json("/server_info")["engine"].get("loras") or {}
    if loras.get("lora_dir"):
        return
    serves = ", ".join(listed) if listed else "none"
    raise DiffserveError(
        f"the diffserve server has no LoRA named {unknown[0]!r} (it serves: {serves}); start it with "
        "--lora NAME=PATH or --lora-dir DIR"
    )
