"""`DecodeTask`: one request's post-denoise phase (its VAE decode) run a chunk at a time, so the engine's
one loop interleaves a long decode with other requests' denoising steps and can stop it between chunks.

The decode keeps its plain, nested call stack (the pipeline's stages, `decode_split`, the VAE's loops)
and runs on a thread of its own, but never beside the engine loop: it runs only while the driving thread
waits in `advance()`, and hands control back at its next chunk boundary (`vae_tiling.decode_chunk_boundary`,
called by every VAE decode loop before each chunk). So one thing runs at a time, as before: a coroutine
with a thread for its stack. `cancel()` unwinds a paused decode: it raises RequestCancelledError at the
boundary where it waits, and its partial outputs are dropped.

The thread runs in a copy of the driving thread's context (the engine's model scope, the decode's tiling
scope) with the platform's device bound; torch's grad mode is the stage's own (`torch.inference_mode`).
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from diffserve.errors import RequestCancelledError
from diffserve.vae_tiling import decode_chunk_scope

T = TypeVar("T")


class DecodeTask(Generic[T]):
    """`call()` run chunk by chunk: `advance()` runs it to its next chunk boundary (or to its end)."""

    def __init__(
        self, call: Callable[[], T], name: str, bind_device: Callable[[], None] = lambda: None
    ) -> None:
        self._call, self._bind_device = call, bind_device
        self._resume = threading.Semaphore(0)  # driver -> decode: run to the next boundary
        self._paused = threading.Semaphore(0)  # decode -> driver: at a boundary, or ended
        self._cancelled = False
        self._started = False
        #: Set once `call` has returned (`result`) or raised (`error`, RequestCancelledError when cancelled).
        self.done = False
        self.result: T | None = None
        self.error: BaseException | None = None
        #: Chunk boundaries passed so far.
        self.chunks = 0
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._main,), name=name, daemon=True)

    def advance(self) -> bool:
        """Run the decode until its next chunk boundary or its end (the caller waits meanwhile); True once
        it has ended (`result` or `error` set)."""
        if self.done:
            return True
        if not self._started:
            self._started = True
            self._thread.start()
        self._resume.release()
        self._paused.acquire()
        return self.done

    def cancel(self) -> None:
        """Stop the decode where it is paused: it raises RequestCancelledError there and unwinds (this
        waits for that); a decode not started yet never starts."""
        self._cancelled = True
        if not self._started:
            self.done, self.error = True, RequestCancelledError("cancelled before its decode started")
            return
        while not self.advance():
            pass
        self._thread.join()

    def _main(self) -> None:
        self._resume.acquire()
        try:
            self._bind_device()
            with decode_chunk_scope(self._boundary):
                self._check_cancelled()
                self.result = self._call()
        except BaseException as exc:  # handed to the driver, which fails or cancels the request
            self.error = exc
        finally:
            self.done = True
            self._paused.release()

    def _boundary(self) -> None:
        """Between two chunks: hand control back to the driver, and go on (or stop) when it says so."""
        self.chunks += 1
        self._paused.release()
        self._resume.acquire()
        self._check_cancelled()

    def _check_cancelled(self) -> None:
        if self._cancelled:
            raise RequestCancelledError(f"cancelled during its decode (after {self.chunks} chunk(s))")
