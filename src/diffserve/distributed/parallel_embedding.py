"""An embedding table whose columns (its embedding features) are split over the ranks of a TP group.

T5's relative position bias is an `nn.Embedding(num_buckets, num_heads)`: one column per attention head.
When the heads are split over the group (`tensor_parallel.py`'s column-parallel q/k/v), each rank needs
the bias of its own heads only, i.e. its range of the table's columns. A lookup then gives each rank its
heads' biases with no communication: every row is held, so any index resolves locally.

`ColumnParallelEmbedding` is built with the shard's shape (on the meta device, before any weight is
read) and names the part of the checkpoint's full table it holds (`shard_specs`, as the parallel linears
do), so the loader reads only those columns.
"""

from __future__ import annotations

import torch
from torch import nn

from diffserve.layers.tensor_parallel import ShardSpec, TensorParallelRank, shard_ranges


class ColumnParallelEmbedding(nn.Embedding):
    """One rank's columns of a `num_embeddings x full_embedding_dim` table; a lookup returns this rank's
    slice of each embedding (no communication)."""

    def __init__(
        self,
        num_embeddings: int,
        full_embedding_dim: int,
        tp: TensorParallelRank,
        padding_idx: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        ranges = shard_ranges((full_embedding_dim,), tp.tp_size, tp.tp_rank)
        super().__init__(
            num_embeddings,
            full_embedding_dim // tp.tp_size,
            padding_idx=padding_idx,
            device=device,
            dtype=dtype,
        )
        self.full_embedding_dim = full_embedding_dim
        self.tp_size, self.tp_rank = tp.tp_size, tp.tp_rank
        self._weight_spec = ShardSpec((num_embeddings, full_embedding_dim), 1, ranges)

    @classmethod
    def replacing(cls, embedding: nn.Embedding, tp: TensorParallelRank) -> ColumnParallelEmbedding:
        """The shard of a plain `embedding` (same rows, padding index, device and dtype: meta before
        loading). A table with `max_norm` renormalises whole rows, which a column shard cannot see: it is a
        TypeError, as is any Embedding subclass."""
        if type(embedding) is not nn.Embedding or embedding.max_norm is not None:
            raise TypeError(
                f"only a plain nn.Embedding without max_norm can be column-sharded, got {type(embedding).__name__}"
                f"(max_norm={getattr(embedding, 'max_norm', None)})"
            )
        weight = embedding.weight
        return cls(
            embedding.num_embeddings, embedding.embedding_dim, tp, embedding.padding_idx,
            device=weight.device, dtype=weight.dtype,
        )  # fmt: skip

    def shard_specs(self) -> dict[str, ShardSpec]:
        """Parameter name -> the part of the checkpoint tensor this rank holds (its columns)."""
        return {"weight": self._weight_spec}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, full_dim={self.full_embedding_dim}, tp_rank={self.tp_rank}/{self.tp_size}"


def parallel_embedding_shards(module: nn.Module) -> dict[str, ShardSpec]:
    """State-dict name -> shard, for every `ColumnParallelEmbedding` weight under `module`."""
    return {
        f"{prefix}.weight" if prefix else "weight": sub.shard_specs()["weight"]
        for prefix, sub in module.named_modules()
        if isinstance(sub, ColumnParallelEmbedding)
    }
