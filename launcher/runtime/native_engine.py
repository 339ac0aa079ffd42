"""The native-PyTorch Engine: model on meta -> parallelisms from the plan -> AdamW steps.

Constructor (``build_native_engine``), all keyword arguments after the first two:

    build_native_engine(
        model_cfg,                 # ModelConfig
        plan,                      # Plan (mesh degrees; its decisions are obeyed, never redone)
        parallel=spec.parallel,    # ParallelConfig (sp, pp_schedule, pp_virtual_stages, pp_layers,
                                   #   microbatches, zero_stage)
        precision=spec.precision,  # PrecisionConfig (fp32 | bf16 | fp8)
        optim=spec.optim,          # OptimConfig
        ac=spec.activation_checkpointing,
        total_steps=spec.trainer.steps,
        grad_clip=spec.trainer.grad_clip,
        seed=spec.trainer.seed,
        compile=spec.trainer.compile,
        offload=spec.offload,      # optional OffloadConfig (cpu -> FSDP2 CPUOffloadPolicy)
        device=torch.device(...),  # this rank's device; the process group is already initialised
    ) -> NativeEngine

``train_step(microbatches)`` takes this data-parallel rank's micro-batches, each (inputs,
labels) int64 [micro_batch, seq_len]; every rank of a TP/PP/CP group passes the same ones.
Labels equal to -100 are ignored. The loss is the mean over every counted token of the
global batch, identical on all ranks.

Order applied to each model part: fp8 -> TP (+ EP) -> AC -> compile -> FSDP, then
materialise with layout-independent init (launcher.models.init).
"""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from pathlib import Path
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launcher.models import build_model
from launcher.parallel.mesh import submesh
from launcher.parallel.optim import build_adamw, build_scheduler, clip_grad_norm
from launcher.runtime.engine import Microbatch, StepStats

log = logging.getLogger(__name__)

IGNORE_INDEX = -100


class NativeEngine:
    """Implements launcher.runtime.engine.Engine with FSDP2 / TP / PP / EP / AC / compile."""

    def __init__(self, model_cfg, plan, *, parallel, precision, optim, ac, total_steps: int,
                 grad_clip: float, seed: int, compile: bool = False, offload=None,
                 device: Optional[torch.device] = None):
        self.model_cfg, self.plan, self.parallel = model_cfg, plan, parallel
        self.precision = precision
        self.grad_clip = grad_clip
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        m = plan.mesh
        self.mesh_plan = m
        distributed = dist.is_initialized()
        if m.world_size > 1 and not distributed:
            raise RuntimeError(
                f"the plan needs {m.world_size} ranks but torch.distributed is not initialised; "
                f"launch through `train` (torchrun) or initialise the process group first"
            )
        self.world = None
        if distributed:
            from launcher.parallel.mesh import build_device_mesh

            self.world = build_device_mesh(m, self.device.type)
        self.tp_rank = self.world["tp"].get_local_rank() if self.world is not None else 0

        if m.dp_replicate * m.dp_shard * m.cp > 1:
            from launcher.parallel.fsdp import check_zero_stage

            check_zero_stage(parallel.zero_stage)  # before any model is built
        if m.cp > 1:
            from launcher.parallel.cp import context_parallel_unsupported_reason

            reason = context_parallel_unsupported_reason(self.device.type)
            if reason:
                raise RuntimeError(reason)
            if m.pp > 1:
                raise ValueError(
                    f"parallel.cp={m.cp} with parallel.pp={m.pp} is not supported by the native "
                    f"engine yet; use one of the two (e.g. put the pp ranks in dp_shard)")
        with torch.device("meta"):
            whole = build_model(model_cfg)
        self.is_moe = model_cfg.n_experts > 0

        # Pipeline split first: every later technique is applied per stage module.
        self.pp_schedule = None
        if m.pp > 1:
            from launcher.parallel.pp import split_into_stages

            self.parts, self.stage_ids = split_into_stages(whole, parallel, self.world["pp"])
        else:
            self.parts, self.stage_ids = [whole], [0]
        for part in self.parts:
            self._parallelize(part, ac, compile, offload)
        for part in self.parts:
            part.to_empty(device=self.device)
            part.init_weights(seed, buffer_device=self.device)
            part.train()
        if m.pp > 1:
            from launcher.parallel.pp import build_schedule

            self.pp_microbatches = self._pp_microbatches(plan.batch.grad_accum_steps)
            self.pp_schedule, self.has_first, self.has_last = build_schedule(
                self.parts, self.stage_ids, parallel, self.world["pp"], self.device, self._loss_fn,
                n_microbatches=self.pp_microbatches,
            )
        else:
            self.has_first = self.has_last = True

        self.optimizers = [build_adamw(p, optim) for p in self.parts]
        self.schedulers = [build_scheduler(o, optim, total_steps) for o in self.optimizers]
        self._token_norm = 1.0
        self._fp8_all_gather = False
        if precision.name == "fp8":
            from launcher.parallel.fp8 import float8_all_gather_enabled

            self._fp8_all_gather = float8_all_gather_enabled(precision.fp8, self.fsdp)
        n_params = sum(_local_numel(p) for part in self.parts for p in part.parameters())
        log.info("native engine ready: %d parameters on this rank (local view), %d model part(s)",
                 n_params, len(self.parts))

    # ---------------------------------------------------------------- building
    def _parallelize(self, part: nn.Module, ac, compile: bool, offload) -> None:
        m, w = self.mesh_plan, self.world
        if self.precision.name == "fp8":
            try:
                from launcher.parallel.fp8 import convert_to_float8
            except ImportError as e:  # the fp8 module is optional until it lands
                raise RuntimeError("precision=fp8 needs launcher/parallel/fp8.py (convert_to_float8)") from e
            convert_to_float8(part, self.precision.fp8, device_type=self.device.type,
                              fsdp_enabled=m.dp_replicate * m.dp_shard * m.cp > 1)
        if m.tp > 1:
            from launcher.parallel.tp import apply_tensor_parallel

            apply_tensor_parallel(part, w["tp"], sequence_parallel=self.parallel.sp,
                                  loss_parallel=True)
        expert_dp_mesh = None
        if m.ep > 1:
            from launcher.parallel.ep import apply_expert_parallel
            from launcher.parallel.mesh import expert_meshes

            ep_mesh, expert_dp_mesh = expert_meshes(w, m.ep)
            apply_expert_parallel(part, ep_mesh)
        if ac is not None and ac.mode != "none":
            from launcher.parallel.ac import apply_activation_checkpointing

            apply_activation_checkpointing(part, ac.mode, ac.selective)
        if compile:
            from launcher.parallel.compile import apply_compile

            apply_compile(part)
        wants_offload = offload is not None and "cpu" in (offload.params, offload.optimizer)
        if wants_offload and w is None:
            raise ValueError(
                "offload.params/optimizer=cpu is done by FSDP2's CPUOffloadPolicy, which needs a process "
                "group: launch through `train` (torchrun), or set offload.optimizer=none")
        # FSDP also wraps a single data-parallel rank when offloading: it is what moves the
        # parameters, gradients and optimizer states to the CPU.
        self.fsdp = m.dp_replicate * m.dp_shard * m.cp > 1 or wants_offload
        if self.fsdp:
            from launcher.parallel.fsdp import apply_fsdp, mixed_precision_policy

            dp_mesh = submesh(w, "hsdp" if m.dp_replicate > 1 else "dp_shard_cp")
            if offload is not None and "nvme" in (offload.params, offload.optimizer):
                raise ValueError(
                    "offload to nvme is DeepSpeed ZeRO-Infinity's; the native FSDP2 path offloads "
                    "to cpu only: set offload.params/optimizer=cpu, or backend.offload=deepspeed")
            apply_fsdp(part, dp_mesh, zero_stage=self.parallel.zero_stage,
                       mp_policy=mixed_precision_policy(self.precision.name, self.precision.reduce_dtype),
                       cpu_offload=wants_offload, pin_memory=bool(offload and offload.pin_memory),
                       expert_dp_mesh=expert_dp_mesh)

    def _pp_microbatches(self, grad_accum: int) -> int:
        """parallel.microbatches, or (-1) max(grad-accumulation steps, pp) when that divides
        this rank's sequences per step, else the grad-accumulation steps."""
        n = self.parallel.microbatches
        if n and n > 0:
            return n
        rows = grad_accum * self.plan.batch.micro_batch_size
        want = max(grad_accum, self.mesh_plan.pp)
        return want if rows % want == 0 else max(grad_accum, 1)

    # ---------------------------------------------------------------- training
    def _autocast(self):
        # Without FSDP there is no MixedPrecisionPolicy; autocast gives the same bf16 compute.
        if self.precision.name in ("bf16", "fp8") and not self.fsdp:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _context_parallel(self, model, inputs, labels):
        if self.mesh_plan.cp > 1:
            from launcher.parallel.cp import context_parallel_region

            return context_parallel_region(model, self.world["cp"], inputs, labels)
        return nullcontext()

    def _loss_parallel(self):
        if self.mesh_plan.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return nullcontext()

    def _loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum of token losses / tokens in the global batch (grads are summed over DP)."""
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum")
        return loss / self._token_norm

    def _count_tokens(self, microbatches: List[Microbatch]) -> float:
        local = sum(int((lab != IGNORE_INDEX).sum()) for _, lab in microbatches)
        t = torch.tensor(float(local), dtype=torch.float64, device=self.device)
        # Over "dp", not "dp_cp": CP ranks receive the same full sequences.
        if self.world is not None and submesh(self.world, "dp").size() > 1:
            dist.all_reduce(t, group=submesh(self.world, "dp").get_group())
        return max(float(t), 1.0)

    def _set_aux_scale(self, n_micro: int) -> None:
        if not self.is_moe:
            return
        ranks = submesh(self.world, "dp_cp").size() if self.world is not None else 1
        for part in self.parts:
            part.set_aux_loss_scale(1.0 / (n_micro * ranks))

    def train_step(self, microbatches: List[Microbatch]) -> StepStats:
        """One optimizer step over this data-parallel rank's micro-batches (collective)."""
        self._token_norm = self._count_tokens(microbatches)
        lr = self.schedulers[0].get_last_lr()[0]
        # Accumulated on the device: no host sync per micro-batch.
        local_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.pp_schedule is None:
            self._set_aux_scale(len(microbatches))
            model = self.parts[0]
            for inputs, labels in microbatches:
                inputs, labels = inputs.to(self.device), labels.to(self.device)
                with self._context_parallel(model, inputs, labels), self._loss_parallel():
                    with self._autocast():
                        logits = model(inputs)
                    loss = self._loss_fn(logits, labels)
                    loss.backward()
                local_loss += _plain(loss.detach())
        else:
            inputs = torch.cat([x for x, _ in microbatches]).to(self.device)
            labels = torch.cat([y for _, y in microbatches]).to(self.device)
            n_micro = self.pp_microbatches
            if inputs.shape[0] % n_micro:
                raise ValueError(
                    f"the pipeline splits this rank's {inputs.shape[0]} sequences per step into "
                    f"parallel.microbatches={n_micro} micro-batches, which does not divide; set "
                    f"parallel.microbatches to a divisor of {inputs.shape[0]} (or -1 for the "
                    f"gradient-accumulation steps)")
            self._set_aux_scale(n_micro)
            losses: list = []
            kwargs = {}
            if self.has_last:
                kwargs.update(target=labels, losses=losses)
            args = (inputs,) if self.has_first else ()
            with self._loss_parallel(), self._autocast():
                self.pp_schedule.step(*args, **kwargs)
            if self.has_last:
                for mb_loss in losses:
                    local_loss += _plain(mb_loss.detach())

        # Global loss: each data-parallel sample counted once (tp rank 0, last pp stage).
        # MoE aux loss for logging: last micro-batch, summed over layers (and stages),
        # averaged over data-parallel ranks.
        counted = self.tp_rank == 0
        aux = sum(p.latest_aux_loss() for p in self.parts) if (self.is_moe and counted) else 0.0
        contrib = float(local_loss) if (counted and self.has_last) else 0.0
        stats = torch.tensor([contrib, aux], dtype=torch.float64)
        if self.world is not None:
            stats = stats.to(self.device)
            dist.all_reduce(stats)
            stats = stats.cpu()
        pp_group = self.world["pp"].get_group() if self.mesh_plan.pp > 1 else None
        params = [p for part in self.parts for p in part.parameters()]
        grad_norm = clip_grad_norm(params, self.grad_clip, pp_group=pp_group)
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if self._fp8_all_gather:
            from launcher.parallel.fp8 import precompute_float8_scales

            for part in self.parts:
                precompute_float8_scales(part)
        for s in self.schedulers:
            s.step()
        extra = {}
        if self.is_moe:
            ranks = submesh(self.world, "dp_cp").size() if self.world is not None else 1
            extra["moe_aux_loss"] = float(stats[1]) / ranks
        return StepStats(loss=float(stats[0]), grad_norm=grad_norm, lr=lr, extra=extra)

    # ---------------------------------------------------------------- state
    def _state(self):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, get_optimizer_state_dict)

        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        model_sd, optim_sd = {}, {}
        for part, opt in zip(self.parts, self.optimizers):
            model_sd.update(get_model_state_dict(part, options=opts))
            optim_sd.update(get_optimizer_state_dict(part, opt, options=opts))
        return {"model": model_sd, "optim": optim_sd,
                "scheduler": {"last_epoch": self.schedulers[0].last_epoch}}

    def save(self, directory: Path) -> None:
        """Write model, optimizer and LR-schedule state with torch.distributed.checkpoint."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), checkpoint_id=str(directory))

    def load(self, directory: Path) -> None:
        """Load a checkpoint written by ``save`` in any layout / world size (collective)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, set_model_state_dict, set_optimizer_state_dict)

        state = self._state()
        dcp.load(state, checkpoint_id=str(directory))
        opts = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
        for part, opt in zip(self.parts, self.optimizers):
            set_model_state_dict(part, state["model"], options=opts)
            set_optimizer_state_dict(part, opt, state["optim"], options=opts)
        last = int(state["scheduler"]["last_epoch"])
        for s in self.schedulers:
            s.last_epoch = last - 1
            s.step()  # recomputes the lr for step `last` into the optimizer's groups

    def export(self, path: Path, fmt: str) -> None:
        """Consolidated fp32 weights on global rank 0: torch.save (fp32) or safetensors."""
        from launcher.parallel.export import gather_full_state_dict, write_state_dict

        full = gather_full_state_dict(self.parts, self.world)
        if full is not None:
            write_state_dict(full, Path(path), fmt)
        if self.world is not None:
            dist.barrier()

    @property
    def model_parts(self) -> List[nn.Module]:
        return self.parts


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A loss as a plain fp64 tensor (loss parallel returns a replicated DTensor)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).double()


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def build_native_engine(model_cfg, plan, **kwargs) -> NativeEngine:
    """Build the NativeEngine (see the module docstring for the arguments)."""
    return NativeEngine(model_cfg, plan, **kwargs)
