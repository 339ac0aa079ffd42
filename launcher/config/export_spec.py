"""`action=export` trains nothing: the training-only settings take values every layout accepts.

A recipe or command line made for training carries a sequence length, batch sizes and a token
budget that an export never uses; they must not refuse it (`trainer.seq_len=2048 exceeds
model.max_seq_len=256` for a small model exported with a big recipe's settings). The engine an
export builds is the training engine, so the values it reads stay consistent rather than
unchecked: the sequence length fits the model and the sequence splits, and the global batch
splits over any data-parallel size of the world.
"""

from __future__ import annotations

import dataclasses
import math

from launcher.config.schema import JobConfig, world_size

# The keys export_spec sets (docs/checkpoints.md lists them for users).
TRAINING_ONLY_KEYS = ("trainer.seq_len", "trainer.global_batch_size", "trainer.tokens", "parallel.microbatches")


def export_spec(spec: JobConfig) -> JobConfig:
    """`spec` itself unless action=export; then the same job with TRAINING_ONLY_KEYS neutral:
    the sequence length at most model.max_seq_len and a multiple of what TP/SP and CP split it by,
    the global batch micro_batch_size x world size (every data-parallel size divides the world,
    and its accumulation, world / dp, is at least the pipeline degree), no token budget, and the
    micro-batch count derived. Idempotent: the ranks read back the config.yaml written from it."""
    if spec.action != "export":
        return spec
    t, p = spec.trainer, spec.parallel
    # lcm of the sequence splits the validator requires (launcher/config/validate.py,
    # _check_batch_and_sequence); non-positive values are left for the validator to name.
    split = math.lcm(p.tp if p.sp and p.tp > 1 else 1, 2 * p.cp if p.cp > 1 else 1)
    seq_len = t.seq_len
    if split > 0 and spec.model.max_seq_len >= split and (seq_len > spec.model.max_seq_len or seq_len % split):
        seq_len = max(split, min(seq_len, spec.model.max_seq_len) // split * split)
    world = world_size(spec.cluster)
    batch = t.micro_batch_size * world if t.micro_batch_size > 0 and world > 0 else t.global_batch_size
    trainer = dataclasses.replace(t, seq_len=seq_len, global_batch_size=batch, tokens=0)
    return dataclasses.replace(spec, trainer=trainer, parallel=dataclasses.replace(p, microbatches=-1))
