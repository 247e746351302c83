"""How diffserve starts its own processes: the server's engine processes and the local rank workers of a
multi-device engine.

The default is multiprocessing's 'spawn': each process is a fresh interpreter that imports torch and
transformers again (about 4.5 s of one core on a small machine), whatever the starting process has done,
an accelerator runtime it initialised or threads it runs included. `DIFFSERVE_START_METHOD` names another:

- 'forkserver': multiprocessing's fork server, a fresh interpreter started once per starting process that
  imports `FORKSERVER_PRELOAD` once and forks every process asked of it. As safe as 'spawn' (nothing of
  the starting process is inherited), and the ranks of an 8-device engine, or a restarted engine, cost
  one import of torch instead of one each. A process that already runs a fork server (the test suite's,
  `diffserve.testing.preloaded`) forks from that one. Its children start with the fork server's
  environment: a rank worker then takes rank 0's (`worker_main`).
- 'fork': forks the starting process itself, with every module it had imported. That pays only where the
  starting process has imported torch and transformers and initialised no accelerator runtime, and has
  run no torch op on several threads (GNU OpenMP's pool does not survive a fork): a server forked from
  the test suite's preloaded interpreter, whose engine then starts in a fraction of a second.

Any other value is an error. A started child first drops what it must not share with its parent
(`forget_parent`: signal handlers, sockets); under 'spawn' and 'forkserver' that call changes nothing.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import stat
from multiprocessing.context import BaseContext

from diffserve.errors import UserError

START_METHOD_ENV = "DIFFSERVE_START_METHOD"
START_METHODS = ("spawn", "forkserver", "fork")
#: What the 'forkserver' start method's server imports before it forks: the engine's and the ranks' heavy
#: imports (the OpenMP wait policy first: it must be set before torch loads).
FORKSERVER_PRELOAD = (
    "diffserve.openmp_env",
    "torch",
    "transformers.modeling_utils",
    "diffserve.distributed.worker",
    "diffserve.server.engine_process",
)


def start_method() -> str:
    """The start method `DIFFSERVE_START_METHOD` names ('spawn' when unset or empty)."""
    method = os.environ.get(START_METHOD_ENV) or "spawn"
    if method not in START_METHODS:
        names = [repr(m) for m in START_METHODS]
        allowed = f"{', '.join(names[:-1])} or {names[-1]}"
        raise UserError(f"{START_METHOD_ENV} must be {allowed}, got {method!r}")
    return method


def process_context() -> BaseContext:
    """The multiprocessing context diffserve starts its processes with (`start_method`)."""
    context = multiprocessing.get_context(start_method())
    if context.get_start_method() == "forkserver":
        context.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # no effect once its server runs
    return context


def forget_parent() -> None:
    """In a started child's main thread, before anything else: drop what a forked child must not share
    with its parent (a spawned one has none of it, and nothing changes).

    - Signal handlers that are Python functions (the server's event loop, uvicorn's SIGTERM) would act on
      the parent's objects: they go back to what a new interpreter has (SIGINT: KeyboardInterrupt, the
      rest: the default); ignored signals stay ignored (as across 'spawn'). The signal wake-up descriptor
      is cleared: a signal sent to the child would wake the parent's event loop.
    - Sockets: the parent's listening socket, its clients' connections (a client would wait for an end of
      its response that never comes while the child held a copy) and its ZeroMQ sockets. Each inherited
      socket descriptor (standard streams excepted) is pointed at /dev/null: its number stays taken, so a
      stale object of the parent that closes it later closes nothing of the child's. Pipes stay: they
      are multiprocessing's own (the parent's sentinel, a rank's watchdog link)."""
    signal.set_wakeup_fd(-1)
    for number in signal.valid_signals():
        try:
            handler = signal.getsignal(number)
        except ValueError:  # not a signal this platform lets Python see
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            default = signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL
            signal.signal(number, default)
    _drop_inherited_sockets()


def _drop_inherited_sockets() -> None:
    listing = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for name in os.listdir(listing):
            fd = int(name)
            if fd <= 2 or fd == null:
                continue
            try:
                mode = os.fstat(fd).st_mode
            except OSError:  # the listing's own descriptor, closed since
                continue
            if stat.S_ISSOCK(mode):
                os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)
