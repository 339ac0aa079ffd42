"""Generate the DeepSpeed JSON from the resolved Layout.

Nobody writes a DeepSpeed config by hand: every key comes from the Layout (batch, stage,
offload targets, ZeRO++ and hpZ, precision, which backend checkpoints activations) plus
the narrow engine options (grad clip, seed). It is written into the run
directory as ``deepspeed_config.json`` and checked with DeepSpeed's own config classes
before launch (launcher/launch/preflight.py) and again by the engine.

Importing this module does not import deepspeed (only ``validate_deepspeed_config`` does).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Dict

from launcher.plan.layout import Layout

CONFIG_FILENAME = "deepspeed_config.json"
# Bucket sizes for ZeRO-3 prefetch / persistence: DeepSpeed's defaults, made explicit.
STAGE3_PREFETCH_BUCKET = 50_000_000
STAGE3_PARAM_PERSISTENCE = 100_000


def _offload_section(device: str, layout: Layout) -> Dict[str, Any]:
    section: Dict[str, Any] = {"device": device, "pin_memory": layout.memory.offload_pin_memory}
    if device == "nvme":
        section["nvme_path"] = layout.memory.offload_nvme_path
    return section


def data_parallel_size(layout: Layout) -> int:
    """DeepSpeed's data-parallel size: every rank that is not a pipeline stage of the same replica."""
    return layout.mesh.dp * layout.mesh.cp * layout.mesh.tp


def build_deepspeed_config(layout: Layout, *, grad_clip: float, seed: int) -> Dict[str, Any]:
    """The DeepSpeed config dict for this job (layout.owners.sharding_backend must be "deepspeed").

    Raises ValueError when the batch arithmetic does not close (global = micro x accum x dp).
    """
    lay = layout
    dp = data_parallel_size(lay)
    micro, accum = lay.batch.micro_batch_size, lay.batch.microbatches
    total = micro * accum * dp
    bf16 = lay.numerics.precision == "bf16"
    zero = int(lay.memory.zero_stage)
    zo: Dict[str, Any] = {
        "stage": zero,
        "contiguous_gradients": True,
        "overlap_comm": False,
        "reduce_scatter": True,
        "reduce_bucket_size": int(lay.deepspeed.reduce_bucket_size),
        "allgather_bucket_size": int(lay.deepspeed.allgather_bucket_size),
    }
    if zero == 3:
        zo["stage3_prefetch_bucket_size"] = STAGE3_PREFETCH_BUCKET
        zo["stage3_param_persistence_threshold"] = STAGE3_PARAM_PERSISTENCE
        zo["zero_quantized_weights"] = bool(lay.deepspeed.zeropp_quantized_weights)
        zo["zero_quantized_gradients"] = bool(lay.deepspeed.zeropp_quantized_gradients)
        zo["zero_hpz_partition_size"] = int(lay.deepspeed.hpz_partition_size)  # resolved (HSDP maps to hpZ)
    if lay.memory.offload_optimizer != "none":
        zo["offload_optimizer"] = _offload_section(lay.memory.offload_optimizer, lay)
    if lay.memory.offload_params != "none":
        zo["offload_param"] = _offload_section(lay.memory.offload_params, lay)

    cfg: Dict[str, Any] = {
        "train_batch_size": total,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": float(grad_clip),
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        "zero_optimization": zo,
        # We pass a torch.optim.AdamW (or DeepSpeedCPUAdam when offloading): same maths and
        # parameter groups as the native path, and no JIT build of DeepSpeed's fused Adam.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
        "seed": int(seed),
    }
    if bf16:
        cfg["communication_data_type"] = "fp32" if lay.numerics.reduce_dtype == "fp32" else "bf16"
        if zero == 1 and lay.memory.offload_optimizer == "none":
            # BF16 optimizer with fp32 gradient accumulation (stage 0 has no master weights).
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if lay.memory.ac_mode != "none" and lay.owners.ac_backend == "deepspeed":
        cfg["activation_checkpointing"] = {
            "partition_activations": False,
            "cpu_checkpointing": False,
            "contiguous_memory_optimization": False,
            "number_checkpoints": None,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        }
    return cfg


def write_deepspeed_config(cfg: Dict[str, Any], run_dir: Path) -> Path:
    """Write ``cfg`` to <run_dir>/deepspeed_config.json atomically and return the path."""
    path = Path(run_dir) / CONFIG_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def validate_deepspeed_config(cfg: Dict[str, Any], dp_size: int):
    """Check ``cfg`` with DeepSpeed's own ``DeepSpeedConfig`` (pydantic ZeRO/offload models,
    batch assertion, sanity checks). Returns the DeepSpeedConfig.

    DeepSpeedConfig takes its world size from torch.distributed (1 when it is not
    initialised), so the batch keys are checked here for ``dp_size`` and handed to
    DeepSpeed rescaled to the world size it sees.
    """
    # lazy: deepspeed is slow to import (DeepSpeed backend only)
    from deepspeed.runtime.config import DeepSpeedConfig

    micro, accum, total = (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"],
                           cfg["train_batch_size"])
    if total != micro * accum * dp_size:
        raise ValueError(f"train_batch_size {total} != {micro} x {accum} x dp {dp_size}")
    seen = _deepspeed_world_size()
    checked = copy.deepcopy(cfg)
    checked["train_batch_size"] = micro * accum * seen
    ds = DeepSpeedConfig(checked)
    if ds.zero_optimization_stage != cfg["zero_optimization"]["stage"]:
        raise ValueError(f"DeepSpeed read stage {ds.zero_optimization_stage}, expected {cfg['zero_optimization']['stage']}")
    return ds


def _deepspeed_world_size() -> int:
    import torch.distributed as dist  # lazy: keeps this config module torch-free; only the DeepSpeed check calls it

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
