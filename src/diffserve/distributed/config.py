"""`ParallelConfig`: how one request's work is split over `num_gpus` ranks (SGLang Diffusion's flags).

`num_gpus = cfg x tp x ring x ulysses`, where cfg is 2 with `--enable-cfg-parallel` (the positive and
negative CFG branches on different ranks) and 1 without. When `--ulysses-degree` is not given it takes
what is left: `num_gpus / (cfg x tp x ring)`, as in SGLang. On the CPU each "gpu" is one rank process
(gloo). Multi-node: `nnodes` machines with `num_gpus / nnodes` ranks each, joined at `dist_init_addr`.

`--tp-size` above 1 shards the DiT's blocks over that many ranks (`layers/tensor_parallel.py`);
whether the model's DiT supports it is checked against the model folder (`api.check_tensor_parallel`,
FLUX today), before anything loads. Text encoders and VAEs stay whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffserve.errors import UserError


class ParallelConfigError(UserError):
    """Degrees that do not multiply to `--num-gpus`, or a multi-node setting that cannot work."""


@dataclass(frozen=True)
class ParallelConfig:
    num_gpus: int = 1
    ulysses_degree: int = 1
    ring_degree: int = 1
    enable_cfg_parallel: bool = False
    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    #: "host:port" of node 0's rendezvous (torch.distributed's TCP store); None: a free loopback port
    #: (one node), or the MASTER_ADDR/MASTER_PORT that torchrun sets.
    dist_init_addr: str | None = None

    def __post_init__(self) -> None:
        _check_positive("--ulysses-degree", self.ulysses_degree)
        _check_positive("--nnodes", self.nnodes)
        _check_common(self.num_gpus, self.ring_degree, self.tp_size)
        product = self.cfg_degree * self.tp_size * self.ulysses_degree * self.ring_degree
        if product != self.num_gpus:
            raise ParallelConfigError(f"--num-gpus {self.num_gpus} but {self._product_text()} = {product}")
        self._check_nodes()

    def _product_text(self) -> str:
        return f"cfg {self.cfg_degree} x tp {self.tp_size} x ulysses {self.ulysses_degree} x ring {self.ring_degree}"

    def _check_nodes(self) -> None:
        if not 0 <= self.node_rank < self.nnodes:
            raise ParallelConfigError(
                f"--node-rank must be in [0, {self.nnodes}) with --nnodes {self.nnodes}"
            )
        if self.num_gpus % self.nnodes:
            raise ParallelConfigError(
                f"--num-gpus {self.num_gpus} is not a multiple of --nnodes {self.nnodes} (ranks per node)"
            )
        if self.dist_init_addr is not None:
            host, sep, port = self.dist_init_addr.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ParallelConfigError(
                    f"--dist-init-addr must be HOST:PORT such as 10.0.0.1:29500, got {self.dist_init_addr!r}"
                )

    @classmethod
    def resolve(
        cls,
        num_gpus: int = 1,
        ulysses_degree: int | None = None,
        ring_degree: int = 1,
        enable_cfg_parallel: bool = False,
        tp_size: int = 1,
        nnodes: int = 1,
        node_rank: int = 0,
        dist_init_addr: str | None = None,
    ) -> ParallelConfig:
        """The config with `ulysses_degree` defaulted (None: what `num_gpus` leaves after cfg x tp x ring)
        and every check applied (ParallelConfigError naming the flags)."""
        if ulysses_degree is None:
            _check_common(num_gpus, ring_degree, tp_size)
            cfg = 2 if enable_cfg_parallel else 1
            rest = cfg * tp_size * ring_degree
            if num_gpus % rest:
                raise ParallelConfigError(
                    f"--num-gpus {num_gpus} is not divisible by cfg {cfg} x tp {tp_size} x ring {ring_degree} "
                    f"= {rest} (the Ulysses degree defaults to what is left)"
                )
            ulysses_degree = num_gpus // rest
        return cls(
            num_gpus,
            ulysses_degree,
            ring_degree,
            enable_cfg_parallel,
            tp_size,
            nnodes,
            node_rank,
            dist_init_addr,
        )

    @property
    def cfg_degree(self) -> int:
        return 2 if self.enable_cfg_parallel else 1

    @property
    def sequence_parallel_degree(self) -> int:
        return self.ulysses_degree * self.ring_degree

    @property
    def ranks_per_node(self) -> int:
        return self.num_gpus // self.nnodes

    @property
    def is_distributed(self) -> bool:
        return self.num_gpus > 1

    def describe(self) -> str:
        return f"{self.num_gpus} rank(s): {self._product_text()}"


def _check_positive(flag: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ParallelConfigError(f"{flag} must be an integer >= 1, got {value!r}")


def _check_common(num_gpus: object, ring_degree: object, tp_size: object) -> None:
    _check_positive("--num-gpus", num_gpus)
    _check_positive("--ring-degree", ring_degree)
    _check_positive("--tp-size", tp_size)
