"""Shared by the DeepSpeed multi-process harness and the tests: specs, data, the torch reference."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Sequence

REPO = Path(__file__).resolve().parents[2]
EXTENSIONS_DIR = REPO / ".cache" / "torch_extensions"

# A tiny fp32 job on 2 ranks: 4 steps, 2 warm-up steps then cosine, clipping active.
BASE = [
    "+recipe=debug", "precision=fp32", "trainer.seq_len=32", "trainer.global_batch_size=8",
    "trainer.micro_batch_size=2", "trainer.steps=4", "optim.warmup_steps=2", "optim.lr=3e-3",
    "trainer.grad_clip=0.5", "cluster.gpus_per_node=2", "checkpoint.interval=0",
]

# name -> overrides on top of BASE. Every case runs in the same torchrun, one after another.
CASES: Dict[str, List[str]] = {
    "zero1": ["parallel.zero_stage=1"],
    "zero2": ["parallel.zero_stage=2", "backend=deepspeed"],
    "zero3": ["parallel.zero_stage=3", "backend=deepspeed"],
    "zero2_cpu_offload": ["parallel.zero_stage=2", "offload=cpu", "backend.offload=deepspeed"],
    # Activation checkpointing inside the DeepSpeed engine: DeepSpeed's own, and torch's op-level selective.
    "zero2_ac_full": ["parallel.zero_stage=2", "backend=deepspeed", "activation_checkpointing=full"],
    "zero1_ac_selective_op": ["parallel.zero_stage=1", "activation_checkpointing=selective"],
}
SLOW_CASES: Dict[str, List[str]] = {
    "pipeline_zero1": ["parallel.zero_stage=1", "parallel.pp=2", "backend=deepspeed"],
    # DeepSpeed swaps only partitions of >= 1 MiB: a wider model so both parameters and
    # optimizer states really go through the NVMe folder.
    "zero3_nvme": ["parallel.zero_stage=3", "offload=nvme", "offload.params=nvme", "offload.pin_memory=false",
                   "model.dim=256", "model.ffn_dim=2048"],
    # The MoE model through DeepSpeed's pipeline engine (compared with the native pipeline: NATIVE_PIPELINE_MOE).
    "pipeline_moe": ["model=debug_moe", "parallel.zero_stage=1", "parallel.pp=2", "backend=deepspeed"],
}
NATIVE_PIPELINE_MOE = ["model=debug_moe", "parallel.pp=2", "backend=native"]
SAVE_AT = 2  # the resume case saves after this many steps


def model_overrides(fields: Dict) -> List[str]:
    """`model.<key>=<value>` overrides of a dict of model fields (a nested dict as Hydra's {k:v,...})."""
    def value(v):
        if isinstance(v, dict):
            return "{" + ",".join(f"{k}:{value(x)}" for k, x in v.items()) + "}"
        return str(v).lower() if isinstance(v, bool) else str(v)
    return [f"model.{k}={value(v)}" for k, v in fields.items()]


def dsv3_bf16(backend: str) -> List[str]:
    """DeepSeek-V3's block on the debug sizes (the layout matrix's, its correction bias moved 0.01 per
    step; two blocks: dense, then MoE) in bf16 under ZeRO-3 (zero.Init makes every float tensor a
    constructor returns bf16, the bias's zeros included): the aux-loss-free balancing case, on
    DeepSpeed or the native engine."""
    from tests.parallel_harness.matrix import DEEPSEEK_V3

    # 3 steps: the bias moves +-0.01 per step and here swings back and forth, so an odd count ends off zero.
    return ["model=debug_moe", *model_overrides(DEEPSEEK_V3), "precision=bf16", "parallel.zero_stage=3",
            "model.n_layers=2", "trainer.steps=3", f"backend={backend}"]


def deepspeed_env(extra: Dict[str, str] = None) -> Dict[str, str]:
    """Environment for DeepSpeed on CPU with the JIT cache inside the repository (git-ignored)."""
    env = dict(os.environ)
    # A cache the caller chose (the Makefile, a shared CI cache) wins over the in-tree default.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(EXTENSIONS_DIR))
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env.update(extra or {})
    return env


def spec_for(overrides: Sequence[str], workdir: Path = None):
    from launcher.config.loader import compose_spec

    extra = list(overrides)
    if workdir is not None and any("nvme" in o for o in overrides):
        extra.append(f"offload.nvme_path={workdir / 'nvme'}")
    return compose_spec([*BASE, *extra])


def global_batch(step: int, spec):
    """Deterministic tokens for one step: inputs, labels int64 [global_batch, seq_len]."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    t = spec.trainer
    tokens = torch.randint(0, spec.model.vocab_size, (t.global_batch_size, t.seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def rank_microbatches(step: int, spec, plan, dp_rank: int):
    """This data-parallel rank's micro-batches (its contiguous slice of the global batch)."""
    inputs, labels = global_batch(step, spec)
    per_rank = spec.trainer.global_batch_size // plan.mesh.dp
    mb = spec.trainer.micro_batch_size
    lo = dp_rank * per_rank
    return [(inputs[i:i + mb], labels[i:i + mb]) for i in range(lo, lo + per_rank, mb)]


def reference_run(spec, steps: int):
    """Plain single-process torch: same model init, AdamW groups, schedule, clipping and loss."""
    import torch

    # One intra-op thread, as in the ranks (OMP_NUM_THREADS=1): CPU reductions split their work
    # by thread count, so the reference must not depend on how many cores the test machine has.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_steps(spec, steps)
    finally:
        torch.set_num_threads(threads)


def _reference_steps(spec, steps: int):
    import torch
    import torch.nn.functional as F

    from launcher.engines.deepspeed import canonical_state_dict, materialise_model
    from launcher.engines.optim import build_adamw, build_scheduler

    model = materialise_model(spec.model, torch.device("cpu"), spec.trainer.seed)
    opt = build_adamw(model, spec.optim)
    sched = build_scheduler(opt, spec.optim, spec.trainer.steps)
    out = []
    for step in range(steps):
        inputs, labels = global_batch(step, spec)
        lr = sched.get_last_lr()[0]
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="mean")
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.trainer.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        out.append({"loss": float(loss), "grad_norm": float(norm), "lr": lr})
    return out, canonical_state_dict(model.state_dict())
