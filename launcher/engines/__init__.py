"""The engines: native PyTorch (native.py) and DeepSpeed (deepspeed.py), one contract (base.py).

Each engine implements one `backend` of the config (`backend=native|deepspeed`): which engine
owns the model states is decided per feature by the planner (launcher/plan/decide/backends.py,
recorded in the Layout's owners), never here. The runtime builds the engine that owns them from
the plan's Layout (`build_engine`); the engine applies launcher/parallel/* as the Layout says.

Below the runtime, checkpoint/ and observe/, above the parallel techniques and the plan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from launcher.engines.base import Engine


def build_engine(model_cfg, optim_cfg, layout, device, options) -> "Engine":
    """The engine of the backend that owns the model states (layout.owners.sharding_backend)."""
    if layout.owners.sharding_backend == "deepspeed":
        # lazy: the engine modules import torch; launcher.engines stays torch-free for deepspeed_config
        from launcher.engines.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(model_cfg, optim_cfg, layout, device, options)
    # lazy: the engine modules import torch; launcher.engines stays torch-free for deepspeed_config
    from launcher.engines.native import NativeEngine

    return NativeEngine(model_cfg, optim_cfg, layout, device, options)
