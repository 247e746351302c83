"""What the native DiT classes share: their config dataclasses' common fields and normalisation
(`DiTConfig`), construction from such a config (`DiffusersDiT`), and the checks and block loop of their
`shard_for_tensor_parallel`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from torch import nn

from diffserve.layers.tensor_parallel import TensorParallelRank
from diffserve.models.config_keys import DiffusersConfigured


class DiTConfig:
    """Mixin of the frozen config dataclasses of the DiTs (Diffusers' `transformer/config.json`, one field
    per key) whose blocks are `num_attention_heads` x `attention_head_dim` wide."""

    num_attention_heads: int
    attention_head_dim: int

    @property
    def inner_dim(self) -> int:
        """The blocks' width, heads x head_dim."""
        return self.num_attention_heads * self.attention_head_dim

    def _normalise(self, **fields: Any) -> None:
        """Replace fields with their normalised values (tuples for sequences, resolved defaults) from
        `__post_init__`: a frozen dataclass sets its own fields through `object.__setattr__`."""
        for name, value in fields.items():
            object.__setattr__(self, name, value)


class DiffusersDiT(DiffusersConfigured, nn.Module):
    """A native DiT with Diffusers' config keys and state-dict names.

    Build it from its config dataclass `config_class` (or `from_config(config_json_dict)`); under
    `torch.device("meta")` it allocates nothing, and `load_state_dict(sd, assign=True, strict=True)`
    fills it. `config` is kept, and the blocks' width as `inner_dim`.
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.inner_dim: int = config.inner_dim

    #: Whether its forward splits its sequence over sequence-parallel ranks (`--ulysses-degree` /
    #: `--ring-degree`); a DiT that cannot is refused at load (`api.check_sequence_parallel`).
    sequence_parallel: ClassVar[bool] = True
    #: The cache methods its forward runs (`configs/cache_rule.py`): none unless the DiT declares them.
    cache_methods: ClassVar[frozenset[str]] = frozenset()
    #: Its block lists, in the order the cache methods count blocks (`cache_block_count`).
    cache_block_lists: ClassVar[tuple[str, ...]] = ()
    #: How many of `cache_block_lists` lead the sequence uncounted by DBCache's Fn and Bn: they always run
    #: (Z-Image's noise refiner; cache-dit's DBCache counts the main layers only).
    cache_leading_lists: ClassVar[int] = 0

    @property
    def hidden_width(self) -> int:
        """The width of the DiT's hidden states (what a latent token's activations scale with)."""
        return self.inner_dim

    def cache_block_count(self) -> int:
        """The blocks a cache method counts (DBCache's Fn/Bn index them): those of `cache_block_lists`."""
        return sum(len(getattr(self, name)) for name in self.cache_block_lists)

    def cache_range_offset(self) -> int:
        """The leading blocks DBCache does not count (those of the first `cache_leading_lists` lists)."""
        return sum(len(getattr(self, name)) for name in self.cache_block_lists[: self.cache_leading_lists])


def check_tp_divides(tp: TensorParallelRank, count: int, refusal: str) -> None:
    """ValueError `--tp-size T: <refusal> over T tensor-parallel ranks` unless `tp.tp_size` divides
    `count` (`refusal` names the model, the count and what it counts: "the X DiT's 24 attention heads do
    not divide")."""
    if count % tp.tp_size:
        raise ValueError(f"--tp-size {tp.tp_size}: {refusal} over {tp.tp_size} tensor-parallel ranks")


def shard_blocks(model: nn.Module, tp: TensorParallelRank, blocks: Iterable[nn.Module]) -> None:
    """Each block's `shard_for_tensor_parallel(tp)`, in a model still built on the meta device: the loader
    then reads only the shards (RuntimeError once any weight is loaded)."""
    if any(not p.is_meta for p in model.parameters()):
        raise RuntimeError("shard_for_tensor_parallel: call it on the meta-built model, before loading")
    for block in blocks:
        block.shard_for_tensor_parallel(tp)
