"""How long a checkpoint save takes, and how long a graceful stop may need.

A stop (SIGTERM, the SLURM warning signal, control/stop) finishes the current step, then
saves. The save writes each rank's model states: the parameters and optimizer states it
holds (launcher/plan/estimate/memory.py's `model_state_memory`, offloaded states included; gradients
are not saved). The ranks of a node share its storage bandwidth (`hardware.storage_gbps`,
GB/s per node), so the predicted save time is the busiest rank's bytes times the ranks per
node over that bandwidth. It is an upper bound where states are replicated (DCP writes a
replicated tensor once) and ignores the file system's aggregate limit across nodes.

The stop time sets torchrun's --shutdown-timeout (how long torchrun waits after forwarding
SIGTERM before it SIGKILLs the ranks), with a factor and a fixed margin because the
prediction is rough and a stop cut short loses the whole save.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional

from launcher.plan.layout import Layout
from launcher.plan.estimate.memory import model_state_memory
from launcher.plan.estimate.params import ModelShape, model_shape, stage_params

# shutdown timeout = STOP_FACTOR * (step + save) + STOP_MARGIN_S: generous on purpose (a
# timeout that is too long only delays the teardown of a failed run; one too short loses work).
STOP_FACTOR = 2.0
STOP_MARGIN_S = 120


def checkpoint_bytes_per_rank(shape: ModelShape, lay: Layout) -> int:
    """Bytes the busiest rank writes: its parameters + optimizer states, on GPU or offloaded."""
    on_device = dataclasses.replace(lay, memory=dataclasses.replace(lay.memory, offload_optimizer="none", offload_params="none"))
    stages = stage_params(shape, lay.mesh.pp, lay.vpp, lay.schedule, lay.pp_layers)
    per_stage = []
    for stage in stages:
        states = model_state_memory(stage, on_device)
        per_stage.append(states["params"] + states["optimizer"])
    return int(max(per_stage))


def save_seconds(bytes_per_rank: int, ranks_per_node: int, storage_gbps: float) -> float:
    """Seconds to write one checkpoint when `ranks_per_node` ranks share `storage_gbps` GB/s."""
    return bytes_per_rank * ranks_per_node / (storage_gbps * 1e9)


def shutdown_timeout_seconds(step_s: float, save_s: float) -> int:
    """torchrun's --shutdown-timeout for a stop that finishes a step and then saves."""
    return int(math.ceil(STOP_FACTOR * (step_s + save_s) + STOP_MARGIN_S))


def lost_work_seconds(interval_steps: int, step_s: float) -> Optional[float]:
    """Expected training time lost per failure when a checkpoint is saved every `interval_steps`:
    a failure lands on average half an interval after the last save. None: no periodic saves
    (everything since the start or the last resume is lost)."""
    if interval_steps <= 0:
        return None
    return interval_steps * step_s / 2


# A failure should cost at most this much training (half a checkpoint interval on average); the
# suggested interval loses half of it. Torchtitan's and Megatron's large-run configs save every
# 20-60 minutes of training for the same reason.
LOST_WORK_WARN_S = 3600.0
SUGGESTED_LOST_S = 1800.0


def lost_work_warnings(checkpoint: Dict[str, Any], step_s: float) -> List[str]:
    """A warning when a failure would lose more than LOST_WORK_WARN_S of training with the
    configured intervals (the node-local tier, when set, bounds the loss), with the interval that
    loses about SUGGESTED_LOST_S."""
    losses = [x for x in (checkpoint.get("lost_per_failure_s"), checkpoint.get("local_lost_per_failure_s")) if x]
    if not losses or min(losses) <= LOST_WORK_WARN_S or step_s <= 0:
        return []
    interval = checkpoint["interval_steps"]
    suggested = max(1, int(2 * SUGGESTED_LOST_S / step_s))
    return [
        f"checkpoint.interval={interval} steps of {step_s:.0f} s loses about {min(losses) / 3600:.1f} h of training "
        f"per failure (half an interval). Fix: checkpoint.interval={suggested} (about {2 * SUGGESTED_LOST_S / 60:.0f} "
        f"minutes of steps), or checkpoint.local_dir for a node-local tier at checkpoint.local_interval."
    ]


def checkpoint_estimate(plan: Any, spec: Any) -> Dict[str, Any]:
    """The `plan.checkpoint` dict: bytes, predicted save and stop time, torchrun's shutdown timeout,
    and the expected work lost per failure for the shared tier (checkpoint.interval) and the
    node-local one (checkpoint.local_interval, when checkpoint.local_dir is set)."""
    shape = model_shape(spec.model)
    lay = plan.layout
    per_rank = checkpoint_bytes_per_rank(shape, lay)
    gbps = float(spec.hardware.storage_gbps)
    save_s = save_seconds(per_rank, plan.gpus_per_node, gbps)
    step_s = float(plan.time.get("step_s", 0.0)) if plan.time else 0.0
    ck = spec.checkpoint
    shared_interval = ck.interval if ck.enabled else 0
    local_interval = ck.local_interval if ck.enabled and ck.local_dir else 0
    return {
        "bytes_per_rank": per_rank,
        "bytes_per_node": per_rank * plan.gpus_per_node,
        "storage_gbps": gbps,
        "save_s": save_s,
        "stop_s": step_s + save_s,  # finish the current step, then save
        "shutdown_timeout_s": shutdown_timeout_seconds(step_s, save_s),
        "interval_steps": shared_interval,
        "lost_per_failure_s": lost_work_seconds(shared_interval, step_s),
        "local_interval_steps": local_interval,
        "local_lost_per_failure_s": lost_work_seconds(local_interval, step_s),
    }
