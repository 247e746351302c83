"""How the ranks of one machine find each other: a TCP store on the loopback that the launching process
opens itself, on a port the OS assigns at that moment, before any rank starts.

Picking a "free" port first and binding it later (inside `init_process_group`) is a race: between the two,
another launch on the machine (another engine, another test worker) can be handed the same port, and then
one store fails to bind (EADDRINUSE) or, worse, the other launch's ranks join this store and both groups
wait for ranks that never come until `--dist-timeout`. A store bound to port 0 has no such window. Its
address travels to the ranks as `diffserve-store://HOST:PORT`; they join it as clients. Multi-node
launches (`--dist-init-addr`) and torchrun keep torch's own rendezvous (`tcp://`, `env://`).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

#: The init-method scheme of a store the launching process opened (`open_local_store`).
LOCAL_STORE_SCHEME = "diffserve-store://"
LOOPBACK = "127.0.0.1"


def open_local_store(world_size: int, timeout: timedelta) -> tuple[dist.TCPStore, str]:
    """A store listening on a loopback port the OS assigns now, and the init method that reaches it. The
    caller keeps the store alive for as long as the group lives (it serves every rank's keys)."""
    store = dist.TCPStore(LOOPBACK, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
    return store, f"{LOCAL_STORE_SCHEME}{LOOPBACK}:{store.port}"


def join_process_group(
    backend: str,
    init_method: str,
    rank: int,
    world_size: int,
    timeout: timedelta,
    store: dist.Store | None = None,
) -> None:
    """`init_process_group` through `init_method`: a `diffserve-store://` address is joined as a client
    of that store (or through `store`, the opener's own); any other is torch's rendezvous URL."""
    if not init_method.startswith(LOCAL_STORE_SCHEME):
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
        )
        return
    if store is None:
        host, _, port = init_method.removeprefix(LOCAL_STORE_SCHEME).rpartition(":")
        store = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
