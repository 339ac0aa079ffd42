"""Build the DeepSpeed JIT ops the suite loads, in the background, while other tests run.

On a fresh clone nothing is built: the first DeepSpeed test used to compile the CPU
accelerator's shared-memory communication op, CPU Adam, pinned memory and async I/O (about
5 minutes of CPU on 2 cores, async I/O alone 3.5) while the suite waited. tests/conftest.py
starts this script at the lowest CPU priority when DeepSpeed tests are collected, so the
compiler only uses the cores the running tests leave idle. A test that needs an op before it
is built waits on torch's build lock in the op's folder (TORCH_EXTENSIONS_DIR), as it would
for any other process building it, and then loads the finished library. Ops already built
are only checked (ninja finds nothing to do).
"""

from __future__ import annotations

import sys
import time

# In the order the suite first needs them (DeepSpeed's init on CPU, the offload and NVMe cases).
OPS = ("ShareMemCommBuilder", "CPUAdamBuilder", "PinMemoryBuilder", "AsyncIOBuilder")


def main() -> int:
    from deepspeed.accelerator import get_accelerator

    failed = 0
    for name in OPS:
        t0 = time.monotonic()
        try:
            get_accelerator().create_op_builder(name).load(verbose=False)
            print(f"prebuild: {name} ready in {time.monotonic() - t0:.1f} s", flush=True)
        except Exception as exc:  # the test that needs the op builds it again and reports the error
            failed += 1
            print(f"prebuild: {name} failed after {time.monotonic() - t0:.1f} s: {exc}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
