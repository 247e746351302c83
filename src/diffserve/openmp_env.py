"""How torch's OpenMP threads wait, chosen before torch loads: imported first by `diffserve/__init__.py`.

An OpenMP runtime reads its wait policy once, when it loads (GNU libgomp in its constructor, which runs at
`import torch`), so this module must not import torch and must run before it. By default a waiting thread
spins (libgomp: about 300,000 polls, milliseconds; Intel's: 200 ms): on a CPU that other processes share,
the spinning threads take the cores the thread everyone waits for needs, and steps become 5-50x slower
(issue 31, `benchmarks/bench_cpu_contention.py`). With the passive policy a waiting thread sleeps.

Variables the user set win: nothing is set when any of `OMP_WAIT_POLICY`, `GOMP_SPINCOUNT` or
`KMP_BLOCKTIME` is in the environment. The values go into `os.environ`, so they also reach every process
diffserve starts (the server's engine, `--dp-size` replicas, `--num-gpus` ranks), whatever this process
had imported first."""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

#: Waiting OpenMP threads sleep: `OMP_WAIT_POLICY` (GNU libgomp, LLVM's and Intel's runtimes) and
#: `KMP_BLOCKTIME` (LLVM's and Intel's runtimes, in milliseconds).
PASSIVE_WAIT = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
#: Any of these in the environment: the user chose how threads wait, and nothing is set.
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def apply_passive_wait(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set `PASSIVE_WAIT` in `environ` unless the user set any of `WAIT_VARIABLES`; returns what was set."""
    if any(name in environ for name in WAIT_VARIABLES):
        return {}
    environ.update(PASSIVE_WAIT)
    return dict(PASSIVE_WAIT)


#: Whether torch (with its OpenMP runtime) was imported before diffserve: then this process's threads keep
#: the policy it loaded with (the processes diffserve starts still get the passive one).
TORCH_LOADED_FIRST = "torch" in sys.modules
#: What `apply_passive_wait` set at import ({} where the user's environment decides).
APPLIED = apply_passive_wait()
