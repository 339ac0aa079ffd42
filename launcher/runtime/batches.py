"""The micro-batches as the engine of this tree takes them (one place to drop once every engine takes Microbatch)."""

from __future__ import annotations


def engine_batches(microbatches):
    """The micro-batches in the form the engines take. Engines that predate the Microbatch record
    (no launcher.engines.base.as_microbatch) unpack (inputs, labels) pairs: they get those, and
    nothing else changes for them (no mixture or document fields reach them)."""
    from launcher.engines import base

    if hasattr(base, "as_microbatch"):
        return microbatches
    return [(mb.inputs, mb.labels) for mb in microbatches]
