"""The native-PyTorch Engine: model on meta -> parallelisms from the Layout -> AdamW steps.

    NativeEngine(model_cfg, optim_cfg, layout, device, options)   # see launcher/engines/base.py

``train_step(microbatches)`` takes this data-parallel rank's micro-batches, each a
``Microbatch`` (inputs, labels int64 [micro_batch, seq_len], optional positions / document_ids
/ sources) or a plain (inputs, labels) tuple; every rank of a TP/PP/CP group passes the same
ones. Labels equal to -100 are ignored. Positions and document ids go to the model's forward
in every path (the pipeline hands them to every stage, see ``_run_pipeline``); with sources
the step also reports the loss per mixture source. The loss is the mean over every counted token of the
global batch, identical on all ranks. With pipelining, the rank's sequences of one step are
split into ``layout.pp_microbatches`` micro-batches (the resolver's one rule).

Order applied to each model part: fp8 -> TP (+ EP) -> AC -> compile -> FSDP, then
materialise with layout-independent init (launcher.models.init). The Layout's rules
(tied embeddings or CP with pipelining, ZeRO stages FSDP2 serves...) were checked by the
resolver; nothing is re-decided here.
"""

from __future__ import annotations

import logging
import re
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import loss_parallel

from launcher import compat
from launcher.engines.base import (EngineOptions, EvalStats, Microbatch, NonFiniteStep, StepStats, as_microbatches,
                                   aux_loss_scale, built_report, local_token_count, model_kwargs, source_means,
                                   source_sums, step_source_count, token_loss_sum, token_losses)
from launcher.engines.greedy import greedy_hits, source_greedy_sums
from launcher.engines.optim import build_scheduler, clip_grad_norm, first_nonfinite_grad
from launcher.engines.muon import optimizer_group_lrs, update_rms_metrics, update_square_sums
from launcher.engines.optimizers import build_optimizer
from launcher.hf.export import export_state
from launcher.hf.weights import export_hf, load_hf_weights
from launcher.models import build_model
from launcher.models.moe import update_correction_bias
from launcher.models.mtp import mtp_targets
from launcher.models.shape import mtp_layers_of, mtp_loss_weight
from launcher.parallel.ac import apply_activation_checkpointing
from launcher.parallel.compile import apply_compile
from launcher.parallel.cp import (context_parallel_region, context_parallel_unsupported_reason, per_row_keys,
                                  shard_for_allgather, use_expanded_kv, use_gathered_kv)
from launcher.parallel.ep import apply_moe_parallel
from launcher.parallel.fp8 import convert_to_float8, float8_scale_precompute_needed, precompute_float8_scales
from launcher.parallel.fsdp import UnshardedAccumulation, apply_fsdp, mixed_precision_policy
from launcher.parallel.device_mesh import build_device_mesh, expert_meshes, submesh
from launcher.parallel.phase import phase_barrier
from launcher.parallel.pp import build_schedule, split_into_stages
from launcher.parallel.tp import apply_tensor_parallel
from launcher.plan.layout import Layout

log = logging.getLogger(__name__)


class NativeEngine:
    """Implements launcher.engines.base.Engine with FSDP2 / TP / PP / EP / AC / compile."""

    def __init__(self, model_cfg, optim_cfg, layout: Layout, device: torch.device, options: EngineOptions):
        self.model_cfg, self.layout, self.options = model_cfg, layout, options
        self.grad_clip = options.grad_clip
        self.device = torch.device(device)
        lay = layout
        m = lay.mesh
        self.mesh_plan = m
        distributed = dist.is_initialized()
        if m.world_size > 1 and not distributed:
            raise RuntimeError(
                f"the plan needs {m.world_size} ranks but torch.distributed is not initialised; "
                f"launch through `train` (torchrun) or initialise the process group first"
            )
        if lay.fsdp_wraps and not distributed:
            raise ValueError(
                "offload.params/optimizer=cpu is done by FSDP2's CPUOffloadPolicy, which needs a process "
                "group: launch through `train` (torchrun), or set offload.optimizer=none")
        self.world = None
        if distributed:
            self.world = build_device_mesh(m, self.device.type)
        self.tp_rank = self.world["tp"].get_local_rank() if self.world is not None else 0

        self.cp_impl = lay.owners.cp_impl
        if m.cp > 1:
            reason = context_parallel_unsupported_reason(self.device.type, self.cp_impl)
            if reason:
                raise RuntimeError(reason)
        with torch.device("meta"):
            whole = build_model(model_cfg)
        self.is_moe = model_cfg.n_experts > 0
        # Multi-token prediction (launcher/models/mtp.py): its loss rides on the logits' backward.
        self.mtp_layers = mtp_layers_of(model_cfg)

        # Pipeline split first: every later technique is applied per stage module.
        self.pp_schedule = None
        if m.pp > 1:
            self.parts, self.stage_ids = split_into_stages(whole, lay, self.world["pp"])
        else:
            self.parts, self.stage_ids = [whole], [0]
        self.fsdp = lay.fsdp_wraps
        for part in self.parts:
            self._parallelize(part)
        if options.fake_mode is not None:
            options.fake_mode.__enter__()  # the rehearsal: no full-size tensor from here on
        for part in self.parts:
            part.to_empty(device=self.device)
            if options.fake_mode is not None:
                pass  # fake tensors have no values to initialise or load
            elif model_cfg.init_from:
                # Each rank reads only the slices its shards hold (no random init first).
                n = load_hf_weights([part], model_cfg.init_from, model_cfg)
                log.info("loaded %d weights of this rank from %s", n, model_cfg.init_from)
            else:
                part.init_weights(options.seed, buffer_device=self.device)
            part.train()
        self.pp_microbatches = lay.pp_microbatches if m.pp > 1 else 1
        if m.pp > 1:
            self.pp_schedule, self.has_first, self.has_last = build_schedule(
                self.parts, self.stage_ids, lay, self.world["pp"], self.device, self._loss_fn,
                n_microbatches=self.pp_microbatches,
            )
        else:
            self.has_first = self.has_last = True

        self.optimizers = [build_optimizer(p, optim_cfg) for p in self.parts]
        self.schedulers = [build_scheduler(o, optim_cfg, options.total_steps) for o in self.optimizers]
        self._token_norm = 1.0
        # Per-source loss sums of the running step (pipeline loss function), sized per step.
        self._n_sources = 0
        self._source_sums = None
        self._greedy_sums = None  # eval_stats(greedy=True) only: per-source greedy token counts
        self._accumulation = None  # launcher.parallel.fsdp.UnshardedAccumulation, built on first use
        self._fp8_all_gather = False
        if lay.owners.fp8_impl == "torchao":
            # Read from the built model: only float8 all-gather under FSDP needs per-step scales.
            self._fp8_all_gather = any(float8_scale_precompute_needed(p) for p in self.parts)
        n_params = sum(_local_numel(p) for part in self.parts for p in part.parameters())
        log.info("native engine ready: %d parameters on this rank (local view), %d model part(s)",
                 n_params, len(self.parts))

    # ---------------------------------------------------------------- building
    def _parallelize(self, part: nn.Module) -> None:
        lay, m, w, opts = self.layout, self.mesh_plan, self.world, self.options
        if lay.owners.fp8_impl == "torchao":
            convert_to_float8(part, lay.fp8_config(), device_type=self.device.type,
                              fsdp_enabled=m.dp * m.cp > 1)
        folded = lay.experts_folded
        if m.tp > 1:
            apply_tensor_parallel(part, w["tp"], sequence_parallel=lay.sp, loss_parallel=True, fold_experts=folded)
        expert_dp_mesh = None
        if self.is_moe and w is not None:
            expert_dp_mesh = apply_moe_parallel(part, w, ep=m.ep, folded=folded, fsdp=self.fsdp)
        if self._cp_allgather:
            use_gathered_kv(part, w["cp"].get_group())
        elif m.cp > 1:
            use_expanded_kv(part)
        if lay.memory.ac_mode != "none":
            apply_activation_checkpointing(part, lay.memory.ac_mode, lay.memory.ac_selective)
        if opts.compile:
            apply_compile(part)
        # FSDP also wraps a single data-parallel rank when offloading: it is what moves the
        # parameters, gradients and optimizer states to the CPU (Layout.fsdp_wraps).
        if self.fsdp:
            dp_mesh = submesh(w, "hsdp" if m.dp_replicate > 1 else "dp_shard_cp")
            apply_fsdp(part, dp_mesh, zero_stage=lay.memory.zero_stage,
                       mp_policy=mixed_precision_policy(lay.numerics.precision, lay.numerics.reduce_dtype),
                       cpu_offload=lay.offload_to_cpu, pin_memory=lay.memory.offload_pin_memory,
                       expert_dp_mesh=expert_dp_mesh)

    def built(self) -> Dict[str, Any]:
        """What this engine built, in Layout terms (read from the built objects, not the Layout)."""
        mesh = {name: 1 for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
        if self.world is not None:
            mesh = {name: self.world[name].size() for name in mesh}

        mesh["ep"] = expert_meshes(self.world, self.mesh_plan.ep, self.layout.experts_folded)[0].size() \
            if self.mesh_plan.ep > 1 else 1
        n_micro = self.pp_schedule._n_microbatches if self.pp_schedule is not None else None
        fsdp = _is_fsdp(self.parts[0])
        backends = {"sharding": "native", "pp": "native" if self.pp_schedule is not None else "off",
                    "fp8": "torchao" if _has_float8(self.parts[0]) else "off"}
        return built_report(mesh, n_micro, fsdp, backends)

    # ---------------------------------------------------------------- training
    def _autocast(self):
        # Without FSDP there is no MixedPrecisionPolicy; autocast gives the same bf16 compute.
        if self.layout.numerics.precision in ("bf16", "fp8") and not self.fsdp:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    @property
    def _cp_allgather(self) -> bool:
        """All-gather context parallelism (Layout.owners.cp_impl): each rank keeps its balanced slice
        of every row, cut by the engine before the forward (or before the pipeline schedule)."""
        return self.mesh_plan.cp > 1 and self.cp_impl == "allgather"

    def context_parallel_slice(self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: Dict[str, Any],
                               document_ids: Optional[torch.Tensor] = None):
        """(inputs, labels, model kwargs) of this rank under all-gather context parallelism: its
        balanced slice (head-tail, or per document with document ids) with positions, document ids
        and the keys' index (launcher/parallel/cp.py); unchanged otherwise (ring attention shards
        inside its region). ``document_ids``: the micro-batch's ids on the host, where the
        per-document split is computed without a device sync."""
        if self._cp_allgather:
            cp = self.world["cp"]
            return shard_for_allgather(inputs, labels, kwargs, cp.size(), cp.get_local_rank(), document_ids)
        return inputs, labels, kwargs

    def forward_inputs(self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: Dict[str, Any], train: bool,
                       document_ids: Optional[torch.Tensor] = None):
        """(inputs, labels, model kwargs) of this rank's forward of one micro-batch: when training
        with multi-token prediction, its depths' tokens and targets taken on the whole rows
        (mtp_targets: the shifts cross the CP slices and stop at documents as on one rank), then
        this rank's context-parallel slice of all of them (context_parallel_slice)."""
        if self.mtp_layers and train:
            kwargs = dict(kwargs, **dict(zip(("mtp_tokens", "mtp_labels"), mtp_targets(
                inputs, labels, self.mtp_layers, kwargs.get("document_ids")))))
        return self.context_parallel_slice(inputs, labels, kwargs, document_ids)

    def _context_parallel(self, model, inputs, labels):
        if self.mesh_plan.cp > 1 and self.cp_impl == "ring":
            return context_parallel_region(model, self.world["cp"], inputs, labels)
        return nullcontext()

    def _loss_parallel(self):
        if self.mesh_plan.tp > 1:
            return loss_parallel()
        return nullcontext()

    def _loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum of token losses / tokens in the global batch (grads are summed over DP).

        In a step with mixture sources, `labels` carries one more column than the logits: each
        row's source index (the pipeline's target is split into micro-batches by rows, so the
        source travels with its labels, whatever order the schedule runs micro-batches in);
        the per-source sums are added to self._source_sums."""
        if self._n_sources and labels.shape[1] == logits.shape[1] + 1:
            return self._loss_with_sources(logits, labels[:, :-1], labels[:, -1])
        return token_loss_sum(logits, labels) / self._token_norm

    def _loss_with_sources(self, logits: torch.Tensor, labels: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
        """The loss (as _loss_fn), accumulating this micro-batch's per-source sums on the device."""
        per = token_losses(logits, labels)
        self._source_sums += source_sums(_plain(per.detach()), labels, sources, self._n_sources)
        if self._greedy_sums is not None:  # eval_stats(greedy=True): lm-eval's is_greedy
            self._greedy_sums += source_greedy_sums(greedy_hits(logits, labels), sources, self._n_sources)
        return per.sum() / self._token_norm

    def _start_sources(self, microbatches: List[Microbatch], n_sources: int = 0) -> None:
        """Size this step's per-source sums (0: no mixture sources in these micro-batches).
        n_sources: how many source indices these micro-batches number (0: the run's mix size)."""
        count = n_sources or self.options.n_sources
        n = step_source_count(microbatches, count)
        if n and not count and self.world is not None:
            t = torch.tensor([n], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # ranks agree on the count (n_sources unknown)
            n = int(t)
        self._n_sources = n
        self._source_sums = torch.zeros(2 * n, dtype=torch.float64, device=self.device) if n else None

    def _check_masking_supported(self, mb: Microbatch) -> None:
        if self.mesh_plan.cp > 1 and self.cp_impl == "ring" and (mb.positions is not None or mb.document_ids is not None):
            raise RuntimeError(
                "document masking / position reset (Microbatch.document_ids, positions) is not supported "
                "with backend.cp_impl=ring: ring attention takes no document mask. "
                "Fix: backend.cp_impl=allgather, or data.document_masking=false and data.reset_positions=false")

    def _forward_loss(self, model: nn.Module, mb: Microbatch, backward: bool) -> torch.Tensor:
        """One micro-batch's forward and loss, and its backward when training."""
        self._check_masking_supported(mb)
        inputs, labels = mb.inputs.to(self.device), mb.labels.to(self.device)
        inputs, labels, kwargs = self.forward_inputs(inputs, labels, model_kwargs(mb, self.device), train=backward,
                                                     document_ids=mb.document_ids)
        with self._context_parallel(model, inputs, labels), self._loss_parallel():
            with self._autocast():
                logits = model(inputs, **kwargs)
            if self._n_sources:
                loss = self._loss_with_sources(logits, labels, mb.sources)
            else:
                loss = self._loss_fn(logits, labels)
            if backward:
                loss.backward()  # inside the context-parallel and loss-parallel regions
        return loss

    def _count_tokens(self, microbatches: List[Microbatch]) -> torch.Tensor:
        # A fill on the device, not a copy from the host (the labels' count is known on the host).
        t = torch.full((), float(local_token_count(microbatches)), dtype=torch.float64, device=self.device)
        # Over "dp", not "dp_cp": CP ranks receive the same full sequences.
        if self.world is not None and submesh(self.world, "dp").size() > 1:
            dist.all_reduce(t, group=submesh(self.world, "dp").get_group())
        # On the device: the losses divide by it there (a float would wait for the device).
        return t.clamp_min(1.0).to(torch.float32)

    def _set_aux_scale(self, n_micro: int) -> None:
        if not self.is_moe:
            return
        # The router's gradients are summed over dp_cp (FSDP) and tp (folded experts); the cp and tp
        # ranks of one data-parallel rank compute one aux loss over their sequences' slices
        # (MoE.token_group), each injecting its slice's share: average over the data-parallel ranks.
        ranks = self.mesh_plan.dp if self.world is not None else 1
        for part in self.parts:
            part.set_aux_loss_scale(aux_loss_scale(n_micro, ranks))

    def _set_mtp_scale(self) -> None:
        """This step's weight of the MTP loss sums: lambda (model.mtp_loss_weights at the tokens
        trained before this step) / depths / the step's token count, as the main loss divides; and
        a fresh per-step sum of the logged loss in every part."""
        if not self.mtp_layers:
            return
        tokens_seen = self.schedulers[0].last_epoch * self.layout.tokens_per_step
        scale = mtp_loss_weight(self.model_cfg, tokens_seen) / self.mtp_layers / self._token_norm
        for part in self.parts:
            part.mtp_loss_scale = scale
            part.mtp_loss_acc = torch.zeros((), dtype=torch.float64, device=self.device)

    def _mtp_step_loss(self) -> torch.Tensor:
        """This rank's sum over the step's micro-batches of the MTP loss (mean over depths) / token count."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for part in self.parts:
            if part.mtp_loss_acc is not None:
                total = total + part.mtp_loss_acc
                part.mtp_loss_acc = None
        return total / self._token_norm

    def _mtp_embedding_copies(self) -> List[nn.Parameter]:
        """This rank's last-stage copies of the embedding (pipelining with multi-token prediction)."""
        return [p.mtp_embeddings.weight for p in self.parts if getattr(p, "mtp_embeddings", None) is not None]

    def _sum_mtp_embedding_grads(self) -> None:
        """Pipelining with multi-token prediction: stage 0's embedding and the last stage's copy
        exchange their gradients and both add the other's (a + b and b + a are the same float), so
        their optimizer steps, and the tables, stay equal, as Megatron's embedding group does. The
        first and the last pipeline rank of each group trade one tensor (the local FSDP shards:
        both tables are sharded alike); under zbv, whose V holds both stages on pipeline rank 0,
        that rank adds them in place."""
        if not self.mtp_layers or self.mesh_plan.pp == 1:
            return
        tables = [p.tok_embeddings.weight for p in self.parts if p.tok_embeddings is not None]
        tables += self._mtp_embedding_copies()
        if not tables:
            return  # a middle stage
        # The local shards: views, added to in place.
        grads = [t.grad.to_local() if hasattr(t.grad, "to_local") else t.grad for t in tables]
        if len(grads) == 2:  # zbv: its V puts the first and the last stage on this rank
            total = grads[0] + grads[1]
            for grad in grads:
                grad.copy_(total)
            return
        pp = self.world["pp"]
        ranks = [int(r) for r in pp.mesh.flatten().tolist()]
        me = pp.get_local_rank()
        peer = ranks[-1] if me == 0 else ranks[0]
        local = grads[0]
        received = torch.empty_like(local)
        ops = [dist.P2POp(dist.isend, local, peer), dist.P2POp(dist.irecv, received, peer)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        local.add_(received)

    def _update_correction_bias(self) -> None:
        """Aux-loss-free balancing (model.bias_update_speed > 0, DeepSeek-V3's sigmoid routers):
        every router's correction bias moves against its expert's load error over this step's
        tokens, summed over all ranks (one all-reduce of [n_layers, n_experts] per step)."""
        speed = float(getattr(self.model_cfg, "bias_update_speed", 0.0) or 0.0)
        if not (self.is_moe and speed > 0):
            return

        # Summed in place over every rank (dist.all_reduce's default op); None on one rank.
        reduce = dist.all_reduce if self.world is not None and dist.is_initialized() and dist.get_world_size() > 1 \
            else None
        # Rows for the main blocks, then the multi-token-prediction blocks (numbered after them).
        update_correction_bias(self.parts, speed, int(self.model_cfg.n_layers) + self.mtp_layers,
                               int(self.model_cfg.n_experts), reduce, device=self.device)

    def _unsharded_accumulation(self):
        """The per-micro-batch FSDP2 sync switches when the Layout holds the step unsharded."""
        if not (self.layout.memory.accumulate_unsharded and self.fsdp and self.pp_schedule is None):
            return None
        if self._accumulation is None:
            self._accumulation = UnshardedAccumulation(self.parts, self.layout.memory.zero_stage)
        return self._accumulation

    def train_step(self, microbatches: List[Microbatch]) -> StepStats:
        """One optimizer step over this data-parallel rank's micro-batches (collective)."""
        microbatches = as_microbatches(microbatches)
        self._token_norm = self._count_tokens(microbatches)
        self._start_sources(microbatches)
        self._set_mtp_scale()
        lr = self.schedulers[0].get_last_lr()[0]
        # Accumulated on the device: no host sync per micro-batch.
        local_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.pp_schedule is None:
            self._set_aux_scale(len(microbatches))
            model = self.parts[0]
            accumulation = self._unsharded_accumulation()
            for i, mb in enumerate(microbatches):
                if accumulation is not None:
                    accumulation.before(last=i == len(microbatches) - 1)
                loss = self._forward_loss(model, mb, backward=True)
                local_loss += _plain(loss.detach())
            if accumulation is not None:
                accumulation.after()
            mtp_loss = self._mtp_step_loss() if self.mtp_layers else None
        else:
            n_micro = self.pp_microbatches
            rows = sum(mb.inputs.shape[0] for mb in microbatches)
            if rows % n_micro:
                raise ValueError(
                    f"the pipeline splits this rank's {rows} sequences per step into the "
                    f"layout's {n_micro} micro-batches, which does not divide: pass the step's "
                    f"micro-batches as planned (micro_batch_size x accumulation sequences)")
            self._set_aux_scale(n_micro)
            for mb_loss in self._run_pipeline("step", microbatches)[0]:
                local_loss += _plain(mb_loss.detach())
            mtp_loss = self._mtp_step_loss() if self.mtp_layers else None
            self._sum_mtp_embedding_grads()

        # Global loss: each data-parallel sample counted once (tp rank 0, last pp stage).
        # MoE aux loss for logging: last micro-batch, summed over layers (and stages),
        # averaged over data-parallel ranks.
        counted = self.tp_rank == 0
        dev = self.device
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        # Kept on the device and reduced there: StepStats reads them when the trainer logs.
        aux = sum((p.latest_aux_loss().to(dev) for p in self.parts), zero) if (self.is_moe and counted) else zero
        contrib = local_loss if (counted and self.has_last) else zero
        mtp = mtp_loss if (mtp_loss is not None and counted and self.has_last) else zero
        pieces = [contrib.reshape(1), aux.reshape(1), mtp.reshape(1)]
        n_sources = self._n_sources
        if n_sources:  # per-source sums ride on the same all-reduce (counted ranks only)
            pieces.append(self._source_sums if (counted and self.has_last)
                          else torch.zeros(2 * n_sources, dtype=torch.float64, device=dev))
        stats = torch.cat(pieces)
        if self.world is not None:
            dist.all_reduce(stats)
        source_loss = stats[3:] if n_sources else {}  # means taken when StepStats is read
        self._n_sources, self._source_sums = 0, None
        pp_group = self.world["pp"].get_group() if self.mesh_plan.pp > 1 else None
        params = [p for part in self.parts for p in part.parameters()]
        grad_norm = clip_grad_norm(params, self.grad_clip, pp_group=pp_group, uncounted=self._mtp_embedding_copies())
        # The one host read per step of numerical health: the norm is global (all-reduced over
        # every shard and stage), so every rank takes the same decision without another collective.
        skipped = None if bool(torch.isfinite(grad_norm)) else self._diagnose_nonfinite(local_loss)
        group_lrs = optimizer_group_lrs(self.optimizers)  # the rates this step uses (before the schedule moves)
        update_sq = None
        if skipped is None:
            for opt in self.optimizers:
                opt.step()
            update_sq = update_square_sums(self.optimizers, dev)
            if self._fp8_all_gather:
                for part in self.parts:
                    precompute_float8_scales(part)
            for s in self.schedulers:
                s.step()
            self._update_correction_bias()
        # A skipped step leaves weights, optimizer state, LR schedule and router biases as they were;
        # its gradients are dropped and its data stays consumed.
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        extra = dict(group_lrs)
        if update_sq is not None:
            if self.world is not None:
                dist.all_reduce(update_sq)  # every rank's shards (each pipeline stage its own)
            extra.update(update_rms_metrics(update_sq))
        if self.is_moe:
            ranks = submesh(self.world, "dp_cp").size() if self.world is not None else 1
            extra["moe_aux_loss"] = stats[1] / ranks
        if self.mtp_layers:  # the mean over depths of their token losses (not under loss/: per source)
            extra["mtp/loss"] = stats[2]
        return StepStats(loss=stats[0], grad_norm=grad_norm, lr=lr, extra=extra, source_loss=source_loss,
                         skipped=skipped)

    def _diagnose_nonfinite(self, local_loss: torch.Tensor) -> NonFiniteStep:
        """This rank's view of a skipped step (host reads: only when a step is skipped)."""
        named = ((name, p) for part in self.parts for name, p in part.named_parameters())
        return NonFiniteStep(local_loss_finite=bool(torch.isfinite(local_loss)),
                             first_nonfinite=first_nonfinite_grad(named))

    def _run_pipeline(self, method: str, microbatches: List[Microbatch]) -> Tuple[list, Any]:
        """One pass of the pipeline schedule (`method`: "step" trains, "eval" is forward only) over
        this rank's sequences; returns the last stage's per-micro-batch losses and its merged
        outputs (logits; what the schedule returns: ([], None) on other stages).

        Positions and document ids are given to the schedule as model keyword arguments on every
        rank: torch splits them into micro-batches like the inputs and passes each stage its
        micro-batch's slice (kwargs reach every stage, positional inputs only the first). Every rank
        of a pipeline group holds the step's micro-batches anyway, so nothing extra is sent between
        stages, and each stage builds the attention mask for its own layers from the ids (a mask
        sent as an activation would cost s*s bytes per micro-batch on the wire). Mixture sources
        ride as one more target column (see _loss_fn)."""
        dev = self.device
        for mb in microbatches:
            self._check_masking_supported(mb)
        inputs = torch.cat([mb.inputs for mb in microbatches]).to(dev)
        kwargs = {}
        first = microbatches[0]
        host_docs = None
        if first.positions is not None:
            kwargs["positions"] = torch.cat([mb.positions for mb in microbatches]).to(dev)
        if first.document_ids is not None:
            host_docs = torch.cat([mb.document_ids for mb in microbatches])
            kwargs["document_ids"] = host_docs.to(dev)
        losses: list = []
        train = method == "step"
        labels = torch.cat([mb.labels for mb in microbatches]).to(dev)
        inputs, labels, kwargs = self.pipeline_inputs(inputs, labels, kwargs, train, document_ids=host_docs)
        if self.has_last:
            if self._n_sources:
                sources = torch.cat([mb.sources for mb in microbatches]).to(dev, labels.dtype)
                labels = torch.cat([labels, sources.unsqueeze(1)], dim=1)
            kwargs.update(target=labels, losses=losses)
        args = (inputs,) if self.has_first else ()
        with self._loss_parallel(), self._autocast():
            outputs = getattr(self.pp_schedule, method)(*args, **kwargs)
        return losses, outputs

    def pipeline_inputs(self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: Dict[str, Any], train: bool,
                        document_ids: Optional[torch.Tensor] = None):
        """(inputs, labels, model kwargs) of one pipeline pass over the whole step's rows, before the
        schedule cuts them into micro-batches: when training with multi-token prediction, every
        stage gets the depths' targets (the last one's MTP reads them); under all-gather context
        parallelism, this rank's slices (forward_inputs). Every rank of a pipeline group cuts the
        rows alike (the split is a function of the rows alone), so the hidden states a stage sends
        are the slices its peer stage expects; the keys' index goes per row, cut with the rows."""
        if not ((self.mtp_layers and train) or self._cp_allgather):
            return inputs, labels, kwargs
        inputs, labels, kwargs = self.forward_inputs(inputs, labels, kwargs, train=train, document_ids=document_ids)
        if self._cp_allgather:
            kwargs["keys"] = per_row_keys(kwargs["keys"], inputs.shape[0])
        return inputs, labels, kwargs

    def eval_step(self, microbatches: List[Microbatch]) -> float:
        """Mean token loss over the global batch of these micro-batches, forward only (collective).

        No gradients, no optimizer or schedule change, no random numbers: training is unaffected.
        With pipelining only the last stage computes the loss; the all-reduce gives it to every rank.
        """
        return self.eval_stats(microbatches).loss

    def eval_stats(self, microbatches: List[Microbatch], n_sources: int = 0, greedy: bool = False) -> EvalStats:
        """eval_step's loss with the global token count and, with Microbatch.sources, the loss and
        token count per mixture source (one all-reduce, as eval_step). n_sources: how many source
        indices the micro-batches number (0: the run's mix; downstream evaluation numbers rows).
        greedy: also the per-source count of tokens that were their logits' argmax (across the
        vocabulary shards under loss parallelism; the last pipeline stage's, as the loss)."""
        microbatches = as_microbatches(microbatches)
        self._token_norm = self._count_tokens(microbatches)
        self._start_sources(microbatches, n_sources)
        n = self._n_sources
        if greedy and n:
            self._greedy_sums = torch.zeros(n, dtype=torch.float64, device=self.device)
        local_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        try:
            with torch.no_grad():
                if self.pp_schedule is None:
                    model = self.parts[0]
                    for mb in microbatches:
                        local_loss += _plain(self._forward_loss(model, mb, backward=False))
                else:
                    for mb_loss in self._run_pipeline("eval", microbatches)[0]:
                        local_loss += _plain(mb_loss.detach())
            counted = self.tp_rank == 0 and self.has_last
            contrib = float(local_loss) if counted else 0.0
            total = torch.tensor([contrib], dtype=torch.float64)
            parts = [total]
            if n:
                parts.append(self._source_sums.cpu() if counted else torch.zeros(2 * n, dtype=torch.float64))
            if self._greedy_sums is not None:
                parts.append(self._greedy_sums.cpu() if counted else torch.zeros(n, dtype=torch.float64))
            total = torch.cat(parts)
            if self.world is not None:
                total = total.to(self.device)
                dist.all_reduce(total)
                total = total.cpu()
        finally:  # even when the call fails: a training step never counts greedy tokens
            has_greedy = self._greedy_sums is not None
            self._n_sources, self._source_sums, self._greedy_sums = 0, None, None
        source_loss, source_tokens = source_means(total[1:1 + 2 * n]) if n else ({}, {})
        source_greedy = ({i: float(total[1 + 2 * n + i]) for i in source_tokens} if has_greedy else {})
        return EvalStats(loss=float(total[0]), tokens=float(self._token_norm), source_loss=source_loss,
                         source_tokens=source_tokens, source_greedy=source_greedy)

    # ---------------------------------------------------------------- state
    def _state(self):
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        model_sd, optim_sd = {}, {}
        for part, opt in zip(self.parts, self.optimizers):
            model_sd.update(get_model_state_dict(part, options=opts))
            optim_sd.update(get_optimizer_state_dict(part, opt, options=opts))
        return {"model": model_sd, "optim": optim_sd,
                "scheduler": {"last_epoch": self.schedulers[0].last_epoch}}

    def save(self, directory: Path) -> None:
        """Write model, optimizer and LR-schedule state with torch.distributed.checkpoint."""
        dcp.save(self._state(), checkpoint_id=str(directory))

    def save_async(self, directory: Path, process_group: Any, storage_writer: Any) -> Any:
        """Stage model, optimizer and LR-schedule state into host memory, then write it with DCP's
        ``async_save`` from a background thread; returns the write's future (collective).

        Training may go on as soon as this returns: the write reads the staged copy. The host
        buffers (pinned on a GPU) are kept and reused by the next save, which must wait for this
        one. process_group: a gloo group the training loop does not use (the write's collectives
        run on another thread). storage_writer: a DCP FileSystemWriter for `directory`.
        """
        stager = getattr(self, "_async_stager", None)
        if stager is None or not compat.has("dcp_reusable_stager"):
            pinned = self.device.type == "cuda"
            stager = self._async_stager = DefaultStager(StagingOptions(
                use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=False,
                use_non_blocking_copy=False))
        return dcp.async_save(self._state(), checkpoint_id=str(directory), storage_writer=storage_writer,
                              process_group=process_group, async_stager=stager)

    def load(self, directory: Path) -> None:
        """Load a checkpoint written by ``save`` in any layout / world size (collective).

        A pipeline's last-stage copy of the embedding (multi-token prediction's mtp_embeddings) is
        read from the embedding's own entries, weights and optimizer states: every layout's
        checkpoint holds those (a run without pipelining writes no copy), and the copy equals
        them (their gradients are summed each step). A checkpoint's copy is read by no one."""
        state = self._state()
        request = {part: _copy_read_as_original(entries) if part in ("model", "optim") else entries
                   for part, entries in state.items()}
        dcp.load(request, checkpoint_id=str(directory))
        for part in ("model", "optim"):  # DCP replaces non-tensor values: take them back under our names
            state[part] = {name: request[part][read] for name, read in _copy_names(state[part]).items()}
        self._apply_state(state)

    def local_state(self) -> Dict[str, Any]:
        """This rank's own part of `save`'s state, as plain CPU tensors: the local shard of every
        DTensor, copies of plain tensors, the other values as they are (the node-local checkpoint
        tier, launcher/checkpoint/local_tier.py). Restored by `load_local_state` in the same layout."""
        flat: Dict[str, Any] = {}
        for path, value in _leaves(self._state()):
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                flat[path] = local.detach().to("cpu", copy=True)
            else:
                flat[path] = value
        return flat

    def load_local_state(self, flat: Dict[str, Any]) -> None:
        """Restore what `local_state` returned on this rank, in the same layout (collective, as `load`).

        The saved shards are copied into the local shards of the state `save` would write, which
        is then applied as after a DCP load: the same path, without a file system in between.
        """
        state = self._state()
        leaves = dict(_leaves(state))
        missing = sorted(set(leaves) - set(flat))
        if missing:
            raise ValueError(f"the node-local checkpoint lacks {len(missing)} entries of this model, e.g. "
                             f"{missing[:3]}. Fix: checkpoint.local_dir holds another model's state; clear it.")
        for path, value in leaves.items():
            saved = flat[path]
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                if tuple(local.shape) != tuple(saved.shape):
                    raise ValueError(f"node-local checkpoint entry {path}: shape {tuple(saved.shape)} but this "
                                     f"rank holds {tuple(local.shape)}. Fix: the layout changed; resume from "
                                     f"the shared checkpoint (clear checkpoint.local_dir).")
                with torch.no_grad():
                    local.copy_(saved)
            else:
                _set_leaf(state, path, saved)
        self._apply_state(state)

    def _apply_state(self, state: Dict[str, Any]) -> None:
        """Hand a filled-in `_state()` back to the model parts, optimizers and LR schedules."""
        opts = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
        for part, opt in zip(self.parts, self.optimizers):
            set_model_state_dict(part, state["model"], options=opts)
            set_optimizer_state_dict(part, opt, state["optim"], options=opts)
        last = int(state["scheduler"]["last_epoch"])
        for s in self.schedulers:
            s.last_epoch = last - 1
            s.step()  # recomputes the lr for step `last` into the optimizer's groups

    def export(self, path: Path, fmt: str) -> None:
        """Consolidated fp32 weights written by global rank 0 tensor by tensor: torch.save's file
        (fp32) or safetensors; or
        fmt "hf": `path`/hf in Hugging Face format, streamed one parameter at a time."""
        if fmt == "hf":
            export_hf(self.parts, self.world, Path(path) / "hf", self.model_cfg, self.options.export_dtype,
                      self.options.export_tokenizer_files)
            return

        export_state(self.parts, self.world, Path(path), fmt)  # streamed: one full tensor at a time
        if self.world is not None:
            phase_barrier()  # rank 0 finishes the file alone: not bounded by the collective timeout

    @property
    def model_parts(self) -> List[nn.Module]:
        return self.parts


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A loss as a plain fp64 tensor (loss parallel returns a replicated DTensor)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).double()


_COPY_NAME = re.compile(r"(^|\.)mtp_embeddings\.")


def _copy_names(entries: Dict[str, Any]) -> Dict[str, str]:
    """{state name: the name to read it under}: a flat model or optimizer state's entries of the
    embedding copy (`mtp_embeddings.`, "state.mtp_embeddings.weight.exp_avg"...) under the
    embedding's (`tok_embeddings.`), unless this rank holds that entry too (then each reads its own)."""
    out = {}
    for name in entries:
        original = _COPY_NAME.sub(lambda m: m.group(1) + "tok_embeddings.", name)
        out[name] = original if original == name or original not in entries else name
    return out


def _copy_read_as_original(entries: Dict[str, Any]) -> Dict[str, Any]:
    """`entries` under the names _copy_names reads them by (the same values: DCP loads into them)."""
    return {read: entries[name] for name, read in _copy_names(entries).items()}


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def _is_fsdp(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def _has_float8(module: nn.Module) -> bool:
    return any(type(m).__name__ == "Float8Linear" for m in module.modules())


def _leaves(tree: Any, prefix: Tuple[str, ...] = ()) -> List[Tuple[Tuple[str, ...], Any]]:
    """(path, value) of every non-dict value of a nested dict (a checkpoint state), in order."""
    if not isinstance(tree, dict):
        return [(prefix, tree)]
    out: List[Tuple[Tuple[str, ...], Any]] = []
    for key, value in tree.items():
        out.extend(_leaves(value, prefix + (key,)))
    return out


def _set_leaf(tree: Dict[Any, Any], path: Tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value
