"""The DeepSpeed Engine: same model, data, LR schedule and StepStats as the native path.

Constructor (what the rank runtime builds when ``layout.owners.sharding_backend == "deepspeed"``):

    DeepSpeedEngine(model_cfg, optim_cfg, layout, device, options)   # launcher/engines/base.py

- the process group must already exist (launcher.runtime.dist.init_distributed): DeepSpeed
  reuses it (``deepspeed.init_distributed`` with gloo on CPU, nccl on GPU);
- the DeepSpeed JSON is generated from the Layout (launcher.engines.deepspeed_config), written to
  ``<options.work_dir>/deepspeed_config.json`` and handed to ``deepspeed.initialize``;
- the model is ``launcher.models.build_model`` built on meta and materialised with the same
  layout-independent ``init_weights(seed)`` as the native path; the optimizer is the native
  path's AdamW (same parameter groups), or DeepSpeedCPUAdam when the optimizer is offloaded;
  the LR schedule is ``launcher.engines.optim.lr_factor`` (the one formula both paths use);
- ``layout.mesh.pp > 1`` builds a DeepSpeed ``PipelineModule`` (ZeRO <= 1, checked by the resolver).

Packed documents: without pipelining, positions and document ids go to the model's forward as
on the native path. DeepSpeed's pipeline engine passes one activation tuple between stages and
is not given them: document masking with it is refused before launch (launcher/config/validate.py)
and again here. Mixture sources (per-source loss) work on both paths.

Loss convention (as native): the reported loss is the mean over every counted token of the
global batch. DeepSpeed averages gradients over data-parallel ranks and (pipeline) divides by
the accumulation steps, so each micro-batch's backward loss is rescaled to make the gradient
exactly that of the global-mean loss.
"""

from __future__ import annotations

import contextlib
import logging
import os
import types
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

from launcher.engines.base import (EngineOptions, EvalStats, Microbatch, NonFiniteStep, StepStats, as_microbatches,
                                   aux_loss_scale, built_report, local_token_count, model_kwargs, source_means,
                                   source_sums, step_source_count, token_loss_sum, token_losses)
from launcher.engines.deepspeed_config import build_deepspeed_config, data_parallel_size, write_deepspeed_config
from launcher.engines.greedy import greedy_hits, source_greedy_sums
from launcher.engines.optim import build_adamw, build_scheduler, param_groups
from launcher.engines.deepspeed_universal import (UNIVERSAL, convert_to_universal, layout_record, read_layout_record,
                                                  resume_action, universal_dir, write_layout_record)
from launcher.hf.export import write_state_dict, write_streamed
from launcher.hf.format import tensor_maps
from launcher.hf.weights import HfReader, load_hf_buffers, load_hf_weights
from launcher.models import build_model
from launcher.models.fp32_buffers import fp32_buffers_kept, register_fp32_buffer
from launcher.models.init import canonical_name, full_init_value
from launcher.models.layers import model_rope_table
from launcher.models.moe import latest_aux_loss, set_aux_loss_scale, update_correction_bias
from launcher.parallel.ac import apply_activation_checkpointing
from launcher.parallel.phase import phase_barrier, phase_broadcast
from launcher.plan.layout import Layout

log = logging.getLogger(__name__)
CHECKPOINT_TAG = "state"  # DeepSpeed's sub-folder inside the directory the trainer gives us
_WRAPPED = "_checkpoint_wrapped_module."


def prepare_deepspeed_environment(device_type: str) -> None:
    """Set what DeepSpeed reads at import time; call before the first `import deepspeed`.

    On CPU: DS_ACCELERATOR=cpu (else DeepSpeed probes for CUDA). TORCH_EXTENSIONS_DIR is left to
    the user or CI (default ~/.cache/torch_extensions): the JIT-built ops are cached there.
    """
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def init_deepspeed_distributed(device_type: str) -> None:
    """Join (or reuse) the process group through deepspeed.comm: gloo on CPU, nccl on GPU."""
    prepare_deepspeed_environment(device_type)
    import deepspeed  # lazy: deepspeed is slow to import (DeepSpeed backend only)

    deepspeed.init_distributed(dist_backend="gloo" if device_type == "cpu" else "nccl",
                               dist_init_required=not dist.is_initialized())


# ----------------------------------------------------------------------------- model pieces


def build_optimizer(module: nn.Module, optim, offload_optimizer: str) -> torch.optim.Optimizer:
    """torch AdamW (as native); DeepSpeedCPUAdam (JIT-built once) when the optimizer is offloaded."""
    if offload_optimizer == "none":
        return build_adamw(module, optim)
    groups = param_groups(module, optim.weight_decay)
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # lazy: deepspeed is slow to import (DeepSpeed backend only)

    return DeepSpeedCPUAdam(groups, lr=optim.lr,
                            betas=(optim.beta1, optim.beta2), eps=optim.eps, adamw_mode=True)


def _apply_deepspeed_checkpointing(model: nn.Module, mode: str, selective: str) -> int:
    """Recompute blocks with deepspeed.checkpointing (full, or every N-th block)."""
    import deepspeed  # lazy: deepspeed is slow to import (DeepSpeed backend only)

    every = 1 if mode == "full" else int(selective)
    wrapped = 0
    for name, block in model.layers.items():
        if int(name) % every:
            continue
        inner = block.forward

        def forward(x, rope, mask=None, _inner=inner):
            if mask is None:
                return deepspeed.checkpointing.checkpoint(_inner, x, rope)
            return deepspeed.checkpointing.checkpoint(_inner, x, rope, mask)

        block.forward = forward
        wrapped += 1
    return wrapped


def apply_checkpointing(model: nn.Module, layout: Layout) -> None:
    """Activation checkpointing with the implementation the resolver chose (layout.owners.ac_backend)."""
    if layout.memory.ac_mode == "none":
        return
    if layout.owners.ac_backend == "deepspeed":
        n = _apply_deepspeed_checkpointing(model, layout.memory.ac_mode, layout.memory.ac_selective)
        log.info("applied DeepSpeed activation checkpointing to %d of %d blocks", n, len(model.layers))
    else:
        apply_activation_checkpointing(model, layout.memory.ac_mode, layout.memory.ac_selective)


def build_meta_model(model_cfg) -> nn.Module:
    """build_model on the meta device, as plain meta tensors even inside the rehearsal's
    FakeTensorMode (in real runs the unset is a no-op): a FakeTensor parameter makes any later
    move (to_empty, module.to) swap it in place (torch.utils.swap_tensors), which torch refuses
    once a weak reference to it exists (the fake mode's memo holds some); from plain meta
    parameters those moves create new (fake) ones instead."""
    with unset_fake_temporarily(), torch.device("meta"):
        return build_model(model_cfg)


def _in_fake_mode() -> bool:
    """Whether a FakeTensorMode is active (the rehearsal builds the engine inside one)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


@contextlib.contextmanager
def fake_pipeline_counts_readable():
    """While DeepSpeed's pipeline engine is constructed on the rehearsal's fake process group:
    the one tensor ``PipelineEngine.__init__`` (deepspeed/runtime/pipe/engine.py) builds from
    Python ints and reads back, its ``torch.LongTensor(data=[num_params, unique_params])``
    all-reduced over the model-parallel group and then ``.tolist()``-ed for a log line, is made
    a real tensor. Under FakeTensorMode it would be a fake tensor without values and
    ``.tolist()`` raises DataDependentOutputException (aten._local_scalar_dense). On the fake
    group the all-reduce leaves it unchanged, so the log line shows this stage's counts.

    Scoped minimum: only the name ``torch`` inside deepspeed.runtime.pipe.engine is rebound,
    to a proxy that forwards every attribute to torch except ``LongTensor``; restored after.
    """
    import deepspeed.runtime.pipe.engine as pipe_engine  # lazy: deepspeed is slow to import (DeepSpeed backend only)

    class _TorchWithRealLongTensor(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def LongTensor(*args, **kwargs):  # noqa: N802 - torch's name
            with unset_fake_temporarily():
                return torch.LongTensor(*args, **kwargs)

    saved = pipe_engine.torch
    pipe_engine.torch = _TorchWithRealLongTensor("torch")
    try:
        yield
    finally:
        pipe_engine.torch = saved


def materialise_model(model_cfg, device: torch.device, seed: int) -> nn.Module:
    """build_model on meta, then the native path's layout-independent initialisation."""
    model = build_meta_model(model_cfg)
    model.to_empty(device=device)
    if model_cfg.init_from and _holds_fake_tensors(model):
        pass  # the rehearsal: fake tensors have no values to load (init_weights draws none either)
    elif model_cfg.init_from:
        # ZeRO 0-2 and the pipeline engine hold the whole model on each rank before DeepSpeed
        # partitions it, so each rank reads the whole model here.
        load_hf_weights([model], model_cfg.init_from, model_cfg)
    else:
        model.init_weights(seed, buffer_device=device)
    model.train()
    return model


def _holds_fake_tensors(module: nn.Module) -> bool:
    return any(is_fake(p) for p in module.parameters())


@contextlib.contextmanager
def fake_module_stays_put(module: nn.Module, device: torch.device):
    """While DeepSpeed initialises an engine around ``module`` on the rehearsal's fake tensors,
    ``module.to(device)`` returns the module unchanged. Real tensors: nothing changes.

    Why: ``DeepSpeedEngine._configure_distributed_model`` moves the module with
    ``module.to(self.device)`` (ZeRO 0-2 and the pipeline engine; zero.Init models skip it).
    torch's ``Module._apply`` swaps every FakeTensor parameter in place with
    ``torch.utils.swap_tensors``, even when the conversion returns the same tensor, and
    swap_tensors refuses a tensor that has weak references: DeepSpeed's debug name map
    (``deepspeed.utils.debug.param_names``, a ``weakref.finalize`` per parameter, set earlier in
    the same constructor) holds one to every parameter, the fake mode's memo to some. (Real
    tensors take the ``param.data =`` branch, which no weak reference blocks.) The parameters
    and buffers already are fake tensors on ``device``, so the move is a no-op; this is
    checked, and only this module object's ``to`` is shadowed (an instance attribute), only
    inside the block.
    """
    if not _holds_fake_tensors(module):
        yield
        return
    device = torch.device(device)
    misplaced = sorted({str(t.device) for t in [*module.parameters(), *module.buffers()] if t.device != device})
    if misplaced:
        raise RuntimeError(f"fake module has tensors on {misplaced}, not {device}: DeepSpeed's module.to() "
                           f"would have to move them")

    def stay(*args, **kwargs):
        targets = [*args, *kwargs.values()]
        if any(not isinstance(a, (str, torch.device)) or torch.device(a) != device for a in targets):
            raise RuntimeError(f"DeepSpeed asked for module.to({args}, {kwargs}) on fake tensors; only a move "
                               f"to {device} (a no-op) is skipped")
        return module

    module.to = stay  # nn.Module.__setattr__ keeps a plain function in the instance __dict__
    try:
        yield
    finally:
        del module.__dict__["to"]


def build_partitioned_model(model_cfg, ds_config: Dict, device: torch.device, seed: int, offload_params: str,
                            pin_memory: bool) -> nn.Module:
    """ZeRO-3: parameters are partitioned as each module is constructed (deepspeed.zero.Init), so no
    rank ever holds the whole model; then each parameter gets the native path's layout-independent
    initial value, one full parameter at a time (GatheredParameters, written by rank 0). With
    model.init_from, rank 0 reads each full parameter and every rank the mapped buffers."""
    import deepspeed  # lazy: deepspeed is slow to import (DeepSpeed backend only)


    remote = offload_params if offload_params != "none" else None
    with deepspeed.zero.Init(config_dict_or_path=ds_config, remote_device=remote, pin_memory=pin_memory):
        with torch.device(device):
            model = build_model(model_cfg)
    rank = dist.get_rank()
    hf = None
    if model_cfg.init_from and rank == 0:
        # model.init_from: rank 0 reads one full parameter at a time, as the random init draws it.
        hf = (HfReader(model_cfg.init_from), {m.ours: m for m in tensor_maps(model_cfg)})
    with torch.no_grad():
        for name, param in model.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if rank == 0:
                    cname = canonical_name(name)
                    if hf is not None:
                        m = hf[1][cname]
                        full = hf[0].read_ours(m, [(0, s) for s in m.shape])
                    else:
                        # Values drawn on the training device, as init_model_weights(buffer_device=device) does.
                        full = full_init_value(cname, tuple(param.shape), model_cfg, seed, device)
                    param.copy_(full.to(param.device, param.dtype))
    if model_cfg.init_from:
        # Buffers are not partitioned (each rank holds them whole): every rank reads the mapped
        # ones itself. Without this DeepSeek-V3's router correction bias would stay at zero.
        load_hf_buffers([model], model_cfg.init_from, model_cfg)
    # zero.Init made the tensors of the table's arithmetic in the training dtype: computed again in fp32.
    model.rope = model_rope_table(model_cfg, device=device)
    model.train()
    return model


def canonical_state_dict(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """fp32 CPU tensors under the model's own names (activation-checkpoint wrappers removed)."""
    return {k.replace(_WRAPPED, ""): v.detach().to("cpu", torch.float32) for k, v in sd.items()}


# ----------------------------------------------------------------------------- pipeline


class _EmbedStage(nn.Module):
    def __init__(self, emb: nn.Embedding):
        super().__init__()
        self.tok_embeddings = emb

    def forward(self, tokens):
        return self.tok_embeddings(tokens)


class _BlockStage(nn.Module):
    """One Transformer block, held as `layers.<its index in the whole model>` so that this stage's
    parameter and module names read as the Transformer's (`<pipeline index>.layers.<i>.…`): the
    moe/* metrics (launcher/observe/moe_health.py) find the MoE layers by that name."""

    def __init__(self, index: int, block: nn.Module, rope: torch.Tensor):
        super().__init__()
        self.layers = nn.ModuleDict({str(index): block})
        register_fp32_buffer(self, "rope", rope.clone(), persistent=False)

    def forward(self, h):
        (block,) = self.layers.values()
        return block(h, self.rope)


class _HeadStage(nn.Module):
    def __init__(self, norm: nn.Module, output: nn.Module):
        super().__init__()
        self.norm, self.output = norm, output

    def forward(self, h):
        return self.output(self.norm(h))


def pipeline_layers(model: nn.Module) -> List[nn.Module]:
    """The Transformer as a flat layer list for PipelineModule: embedding, blocks, norm + output
    (tied embeddings, which cannot be pipelined, were refused by the validator)."""
    return ([_EmbedStage(model.tok_embeddings)]
            + [_BlockStage(int(i), b, model.rope) for i, b in model.layers.items()]
            + [_HeadStage(model.norm, model.output)])


def _pipeline_name(local_name: str, n_blocks: int) -> str:
    """PipelineModule names its layers by global index: map back to Transformer names."""
    idx, rest = local_name.split(".", 1)
    i = int(idx)
    if i == 0:
        return rest  # tok_embeddings.weight
    if i <= n_blocks:
        return rest  # layers.<i - 1>.… (_BlockStage keeps the Transformer's names)
    return rest  # norm.weight / output.weight


# ----------------------------------------------------------------------------- the engine


class DeepSpeedEngine:
    """Implements launcher.engines.base.Engine on top of deepspeed.initialize."""

    def __init__(self, model_cfg, optim_cfg, layout: Layout, device: torch.device, options: EngineOptions):
        device = torch.device(device)
        init_deepspeed_distributed(device.type)
        import deepspeed  # lazy: deepspeed is slow to import (DeepSpeed backend only)

        self.model_cfg, self.layout, self.options, self.device = model_cfg, layout, options, device
        if int(getattr(model_cfg, "mtp_layers", 0) or 0):
            # The validator refuses backend=deepspeed with it; this catches a resolver that chose DeepSpeed.
            raise ValueError(f"model.mtp_layers={model_cfg.mtp_layers}: the multi-token-prediction loss is wired "
                             f"in the native engine only. Fix: backend=native, or model.mtp_layers=0.")
        lay = layout
        self.dp = data_parallel_size(lay)
        self.pp = lay.mesh.pp
        self.gas = lay.batch.microbatches
        self.config = build_deepspeed_config(lay, grad_clip=options.grad_clip, seed=options.seed)
        self.config_path = None
        if dist.get_rank() == 0 and options.work_dir is not None:
            self.config_path = write_deepspeed_config(self.config, options.work_dir)
        if "nvme" in (lay.memory.offload_optimizer, lay.memory.offload_params):
            Path(lay.memory.offload_nvme_path).mkdir(parents=True, exist_ok=True)

        torch.manual_seed(options.seed)
        if lay.memory.zero_stage == 3 and self.pp == 1:
            model = build_partitioned_model(model_cfg, self.config, device, options.seed, lay.memory.offload_params,
                                            lay.memory.offload_pin_memory)
        elif self.pp > 1 and _in_fake_mode():
            # The rehearsal: PipelineModule moves its stage's layers to the device itself
            # (module.to in its constructor), which turns plain meta parameters into fake ones.
            model = build_meta_model(model_cfg)
        else:
            model = materialise_model(model_cfg, device, options.seed)
        self.is_moe = model_cfg.n_experts > 0
        self.n_blocks = len(model.layers)
        if self.pp > 1:
            from deepspeed.pipe import PipelineModule  # lazy: deepspeed is slow to import (DeepSpeed backend only)

            interval = 0
            if lay.memory.ac_mode != "none":
                # The resolver gives the pipeline engine's own checkpointing (ac_backend=deepspeed).
                interval = 1 if lay.memory.ac_mode == "full" else int(lay.memory.ac_selective)
            module = PipelineModule(layers=pipeline_layers(model), num_stages=self.pp, loss_fn=self._pipe_loss,
                                    partition_method="type:_BlockStage", activation_checkpoint_interval=interval)
        else:
            apply_checkpointing(model, lay)
            module = model
        self._model_ref = module
        optimizer = build_optimizer(module, optim_cfg, lay.memory.offload_optimizer)

        self.scheduler = build_scheduler(optimizer, optim_cfg, options.total_steps)
        pipeline_on_fake = self.pp > 1 and _in_fake_mode()
        # DeepSpeed's bf16/fp16 mode may cast buffers with the parameters: the ones the model declared
        # float32 (RoPE tables, the router's correction bias) come back as they were.
        with fake_module_stays_put(module, device), fp32_buffers_kept(module), \
                (fake_pipeline_counts_readable() if pipeline_on_fake else contextlib.nullcontext()):
            # Real tensors: the first and last have no effect.
            self.engine, self.optimizer, _, _ = deepspeed.initialize(
                model=module, optimizer=optimizer, lr_scheduler=self.scheduler, config=self.config,
                dist_init_required=False,
            )
        self._token_norm = 1.0
        self._n_sources = 0  # per-source loss sums of the running step (0: no mixture sources)
        self._source_sums = None
        self._greedy_sums = None  # eval_stats(greedy=True) only: per-source greedy token counts
        self._pipe_losses: List[torch.Tensor] = []
        self.last_load = ""  # how the last `load` went: plain | universal (converted|reused)
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
        log.info("DeepSpeed engine ready: ZeRO-%d, %d parameters in this rank's stage, pp=%d, dp=%d, "
                 "config %s", lay.memory.zero_stage, n_params, self.pp, self.dp,
                 self.config_path or "(written by rank 0)")

    # ------------------------------------------------------------------ the Engine contract
    @property
    def model_parts(self) -> List[nn.Module]:
        """This rank's module (the DeepSpeed-wrapped model or pipeline stage)."""
        return [self.engine.module]

    @property
    def optimizers(self) -> List[Any]:
        """DeepSpeed's optimizer (a ZeRO wrapper with the torch optimizer in ``.optimizer``)."""
        return [self.engine.optimizer if getattr(self.engine, "optimizer", None) is not None else self.optimizer]

    def built(self) -> Dict[str, Any]:
        """What DeepSpeed built, read back from the engine (not from the Layout)."""
        cfg = self.engine.config if isinstance(getattr(self.engine, "config", None), dict) else self.config
        stages = self.engine.num_stages if self.pp > 1 else 1
        mesh = {"pp": stages, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "ep": 1,
                "dp": self.engine.dp_world_size}
        zero = self.engine.zero_optimization_stage()
        backends = {"sharding": "deepspeed", "pp": "deepspeed" if self.pp > 1 else "off",
                    "zero_stage": zero, "fp8": "off",
                    "offload_optimizer": cfg["zero_optimization"].get("offload_optimizer", {}).get("device", "none"),
                    "offload_param": cfg["zero_optimization"].get("offload_param", {}).get("device", "none")}
        backends["gradient_accumulation_steps"] = self.engine.gradient_accumulation_steps()
        pp_micro = self.engine.micro_batches if self.pp > 1 else None
        return built_report(mesh, pp_micro, False, backends)

    # ------------------------------------------------------------------ step
    def _pipe_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self._n_sources and labels.shape[1] == logits.shape[1] + 1:
            # Mixture sources ride as one more label column (the pipeline hands the loss only labels).
            loss = self._loss_with_sources(logits, labels[:, :-1], labels[:, -1])
        else:
            loss = self._per_token(token_loss_sum(logits, labels))
        self._pipe_losses.append(loss.detach().to(torch.float64))  # summed on the device
        # The pipeline engine averages over dp and divides by the accumulation steps.
        return loss * (self.dp * self.gas)

    def _loss_with_sources(self, logits: torch.Tensor, labels: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
        """Sum of token losses / global tokens, accumulating the per-source sums on the device."""
        per = token_losses(logits, labels)
        self._source_sums += source_sums(per.detach(), labels, sources, self._n_sources)
        self._add_greedy(logits, labels, sources)
        return self._per_token(per.sum())

    def _add_greedy(self, logits: torch.Tensor, labels: torch.Tensor, sources: torch.Tensor) -> None:
        """eval_stats(greedy=True): count per source the tokens that were their logits' argmax."""
        if self._greedy_sums is not None:
            self._greedy_sums += source_greedy_sums(greedy_hits(logits, labels), sources, self._n_sources)

    def _start_sources(self, microbatches: List[Microbatch], n_sources: int = 0) -> None:
        """Size this step's per-source sums (see NativeEngine._start_sources)."""
        count = n_sources or self.options.n_sources
        n = step_source_count(microbatches, count)
        if n and not count:
            t = torch.tensor([n], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            n = int(t)
        self._n_sources = n
        self._source_sums = torch.zeros(2 * n, dtype=torch.float64, device=self.device) if n else None

    def _pipeline_batches(self, microbatches: List[Microbatch]) -> list:
        """(inputs, labels) per micro-batch for the pipeline engine's data iterator; with sources the
        labels carry each row's source index as one more column (see _pipe_loss)."""
        out = []
        for mb in microbatches:
            if mb.positions is not None or mb.document_ids is not None:
                raise RuntimeError(
                    "document masking / position reset is not supported with DeepSpeed's pipeline engine "
                    "(backend.pp=deepspeed): its stages pass one activation tuple and take no document ids. "
                    "Fix: use the native pipeline (backend.pp=native), parallel.pp=1, or "
                    "data.document_masking=false and data.reset_positions=false")
            labels = mb.labels
            if self._n_sources:
                labels = torch.cat([labels, mb.sources.to(labels.dtype).unsqueeze(1)], dim=1)
            out.append((mb.inputs.to(self.device), labels.to(self.device)))
        return out

    def _forward_loss_sum(self, mb: Microbatch) -> torch.Tensor:
        """One micro-batch's forward and summed token loss (no pipeline)."""
        logits = self.engine(mb.inputs.to(self.device), **model_kwargs(mb, self.device))
        labels = mb.labels.to(self.device)
        if self._n_sources:
            per = token_losses(logits, labels)
            self._source_sums += source_sums(per.detach(), labels, mb.sources, self._n_sources)
            self._add_greedy(logits, labels, mb.sources)
            return per.sum()
        return token_loss_sum(logits, labels)

    def _reduce(self, head: List[torch.Tensor], contributes: bool) -> torch.Tensor:
        """All-reduce `head` (this rank's 0-dim loss terms) and, with sources, the per-source sums;
        the result stays on the device (fp64)."""
        stats = torch.stack([h.reshape(()).to(self.device, torch.float64) for h in head])
        if self._n_sources:
            sums = self._source_sums if contributes else torch.zeros_like(self._source_sums)
            stats = torch.cat([stats, sums])
        if self._greedy_sums is not None:  # eval_stats(greedy=True)
            greedy = self._greedy_sums if contributes else torch.zeros_like(self._greedy_sums)
            stats = torch.cat([stats, greedy])
        dist.all_reduce(stats)
        return stats

    def _count_tokens(self, microbatches: List[Microbatch]) -> torch.Tensor:
        """The global count of loss tokens per pipeline stage (at least 1), a 0-dim fp64 tensor on
        the device: a fill and an all-reduce there, no host wait."""
        t = torch.full((), float(local_token_count(microbatches)), dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        # Every stage of a replica holds the same batch. Divided by a device fill: true division on
        # every device, as the host's float division was (CUDA multiplies by a host scalar's reciprocal).
        return (t / torch.full((), float(self.pp), dtype=torch.float64, device=self.device)).clamp_min(1.0)

    def _per_token(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """`loss_sum` / the step's token count. A training step keeps the count on the device (a
        float would wait for it); the arithmetic is the one dividing by that float did, bit for bit:
        on CUDA torch multiplies by the fp32 reciprocal of a host scalar, on the CPU it divides."""
        norm = self._token_norm
        if not torch.is_tensor(norm):
            return loss_sum / norm
        if loss_sum.is_cuda:
            return loss_sum * torch.reciprocal(norm.to(loss_sum.dtype))
        return loss_sum / norm.to(loss_sum.dtype)

    def _set_aux_scale(self, n_micro: int) -> None:
        # DeepSpeed averages over dp itself (pipeline or not), so only the micro-batch count is
        # divided out: the aux gradient is injected per micro-batch, outside the loss DeepSpeed scales.
        # The module may be a pipeline stage, not a Transformer: the model floor's functions take either.
        set_aux_loss_scale(self._model_ref, aux_loss_scale(n_micro, 1))

    def _update_correction_bias(self) -> None:
        """Aux-loss-free balancing (model.bias_update_speed > 0), as the native engine: after the
        step, loads summed over every rank (collective)."""
        speed = float(getattr(self.model_cfg, "bias_update_speed", 0.0) or 0.0)
        if not (self.is_moe and speed > 0):
            return

        update_correction_bias([self._model_ref], speed, int(self.model_cfg.n_layers), int(self.model_cfg.n_experts),
                               dist.all_reduce if dist.get_world_size() > 1 else None, device=self.device)

    def train_step(self, microbatches: List[Microbatch]) -> StepStats:
        """One optimizer step over this data-parallel rank's micro-batches (collective)."""
        if len(microbatches) != self.gas:
            raise ValueError(
                f"got {len(microbatches)} micro-batches but the DeepSpeed config has gradient_accumulation_steps="
                f"{self.gas} (global {self.layout.global_batch_size} = micro {self.layout.batch.micro_batch_size}"
                f" x {self.gas} x dp {self.dp}); pass exactly that many"
            )
        microbatches = as_microbatches(microbatches)
        self._token_norm = self._count_tokens(microbatches)
        self._start_sources(microbatches)
        lr = self.scheduler.get_last_lr()[0]
        # Accumulated on the device (fp64, as the host floats it replaces): no host sync per step.
        local_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        contributes = True
        if self.is_moe:
            self._set_aux_scale(len(microbatches))
        if self.pp > 1:
            self._pipe_losses = []
            self.engine.train_batch(data_iter=iter(self._pipeline_batches(microbatches)))
            for mb_loss in self._pipe_losses:
                local_loss += mb_loss
            contributes = self.engine.is_last_stage()
        else:
            for mb in microbatches:
                loss = self._per_token(self._forward_loss_sum(mb))
                # DeepSpeed averages gradients over dp ranks: scale up so they are summed.
                self.engine.backward(loss * self.dp, scale_wrt_gas=False)
                self.engine.step()
                local_loss += loss.detach().to(torch.float64)
        # DeepSpeed's own overflow skip (ZeRO 1-3 and its bf16 optimizer, fp32 or bf16): a NaN or
        # inf global gradient norm leaves weights, optimizer state and its LR scheduler untouched
        # and clears the gradients, on every rank. A host flag: reading it waits for nothing.
        skipped = None
        if self.engine.was_step_applied():
            self._update_correction_bias()
        else:
            # DeepSpeed has already cleared the gradients: no parameter can be named here.
            skipped = NonFiniteStep(local_loss_finite=bool(torch.isfinite(local_loss)), first_nonfinite=None)
        # MoE aux loss for logging, as the native engine: last micro-batch, summed over the layers
        # of every pipeline stage, averaged over data-parallel replicas.
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        aux = latest_aux_loss(self._model_ref) if self.is_moe else zero
        stats = self._reduce([local_loss if contributes else zero, aux], contributes)
        source_loss = stats[2:] if self._n_sources else {}  # means taken when StepStats is read
        self._n_sources, self._source_sums = 0, None
        norm = self.engine.get_global_grad_norm()  # a tensor or a float, as DeepSpeed keeps it
        extra = {}
        if self.is_moe:
            # Divided by a device fill, not a Python int: true division, as the host's was.
            extra["moe_aux_loss"] = stats[1] / torch.full((), float(self.dp), dtype=torch.float64, device=self.device)
        # Device tensors: StepStats copies them to the host when the trainer reads them.
        return StepStats(loss=stats[0], grad_norm=norm if norm is not None else float("nan"),
                         lr=lr, extra=extra, source_loss=source_loss, skipped=skipped)

    def eval_step(self, microbatches: List[Microbatch]) -> float:
        """Mean token loss over the global batch, forward only (collective); training state untouched."""
        return self.eval_stats(microbatches).loss

    def eval_stats(self, microbatches: List[Microbatch], n_sources: int = 0, greedy: bool = False) -> EvalStats:
        """eval_step's loss with the global token count and, with sources, per-source losses and
        counts, and with greedy the per-source greedy token counts (see NativeEngine.eval_stats)."""
        microbatches = as_microbatches(microbatches)
        # Evaluation reads its loss on the host anyway: the count is a float here.
        self._token_norm = float(self._count_tokens(microbatches))
        self._start_sources(microbatches, n_sources)
        n = self._n_sources
        if greedy and n:
            self._greedy_sums = torch.zeros(n, dtype=torch.float64, device=self.device)
        local_loss = 0.0
        contributes = True
        try:
            with torch.no_grad():
                if self.pp > 1:
                    self._pipe_losses = []
                    self.engine.eval_batch(data_iter=iter(self._pipeline_batches(microbatches)))
                    local_loss = float(sum(self._pipe_losses))
                    contributes = self.engine.is_last_stage()
                else:
                    for mb in microbatches:
                        local_loss += float(self._forward_loss_sum(mb)) / self._token_norm
            head = torch.tensor(local_loss if contributes else 0.0, dtype=torch.float64)
            total = self._reduce([head], contributes).cpu()
        finally:  # even when the call fails: a training step never counts greedy tokens
            has_greedy = self._greedy_sums is not None
            self._n_sources, self._source_sums, self._greedy_sums = 0, None, None
        source_loss, source_tokens = source_means(total[1:1 + 2 * n]) if n else ({}, {})
        source_greedy = ({i: float(total[1 + 2 * n + i]) for i in source_tokens} if has_greedy else {})
        return EvalStats(loss=float(total[0]), tokens=self._token_norm, source_loss=source_loss,
                         source_tokens=source_tokens, source_greedy=source_greedy)

    # ------------------------------------------------------------------ state
    def save(self, directory: Path) -> None:
        """engine.save_checkpoint: model, ZeRO-partitioned optimizer and LR schedule (collective)."""
        self.engine.save_checkpoint(str(directory), tag=CHECKPOINT_TAG, save_latest=False)
        if dist.get_rank() == 0:
            # What wrote it, so that a resume at another layout knows to convert (deepspeed_universal).
            write_layout_record(directory, self._layout_record())

    def _layout_record(self) -> Dict[str, Any]:
        return layout_record(world_size=dist.get_world_size(), dp=self.dp, zero_stage=self.layout.memory.zero_stage,
                             pp=self.pp, offload_optimizer=self.layout.memory.offload_optimizer)

    def load(self, directory: Path) -> None:
        """engine.load_checkpoint of what `save` wrote (collective). Saved at another data-parallel
        size or ZeRO stage (1-3): converted once to a universal checkpoint and loaded from that
        (launcher/engines/deepspeed_universal.py); what cannot be converted is refused with a Fix."""
        self.last_load = "plain"
        if resume_action(read_layout_record(directory), self._layout_record()) == UNIVERSAL:
            self._load_universal(Path(directory))
            return
        path, _ = self.engine.load_checkpoint(str(directory), tag=CHECKPOINT_TAG, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise RuntimeError(
                f"DeepSpeed found no checkpoint under {directory}/{CHECKPOINT_TAG}. DeepSpeed checkpoints load at the "
                f"world size and ZeRO stage that wrote them (this run: {dist.get_world_size()} ranks, ZeRO-"
                f"{self.layout.memory.zero_stage}). Fix: resume with the saving layout, or checkpoint.resume=none."
            )

    def _load_universal(self, directory: Path) -> None:
        """Rank 0 converts (once, kept beside the checkpoint); every rank loads the universal folder."""
        outcome = None
        if dist.get_rank() == 0:
            try:
                outcome = "converted" if convert_to_universal(directory, CHECKPOINT_TAG) else "reused"
            except Exception as err:  # noqa: BLE001 - every rank must leave, not wait for rank 0
                log.exception("universal conversion of %s failed", directory)
                outcome = f"failed: {type(err).__name__}: {err}"
        outcome = phase_broadcast(outcome)  # rank 0 converts alone: not bounded by the collective timeout
        if outcome.startswith("failed"):
            raise RuntimeError(f"converting the DeepSpeed checkpoint {directory} to a universal checkpoint {outcome}")
        self.last_load = f"universal ({outcome})"
        log.info("loading %s as a universal checkpoint (%s from %s)", universal_dir(directory), outcome, directory)
        # DeepSpeed reads checkpoint.load_universal only inside load_checkpoint, so it is switched on
        # for this load alone: the run's own later saves stay ordinary checkpoints.
        config = self.engine._config
        decay = [g.get("weight_decay") for g in self.engine.optimizer.param_groups]
        config.load_universal_checkpoint = True
        try:
            path, _ = self.engine.load_checkpoint(str(universal_dir(directory)), tag=CHECKPOINT_TAG,
                                                  load_optimizer_states=True, load_lr_scheduler_states=True)
        finally:
            config.load_universal_checkpoint = False
        if path is None:
            raise RuntimeError(f"DeepSpeed found no universal checkpoint under {universal_dir(directory)}")
        # ZeRO-3's universal load copies the first parameter group's hyperparameters into every
        # group, which would put weight decay on the no-decay group: keep the groups' own.
        for group, wd in zip(self.engine.optimizer.param_groups, decay):
            if wd is not None:
                group["weight_decay"] = wd
        # ...and it hands every flat fp32 partition the same `step` tensor, which torch's AdamW
        # increments in place once per partition: each partition gets its own copy.
        inner = getattr(self.engine.optimizer, "optimizer", None)
        for state in (inner.state.values() if inner is not None else ()):
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    def export(self, path: Path, fmt: str) -> None:
        """The consolidated fp32 model (parameters and persistent buffers, as the native export),
        written by rank 0 as torch.save's file (fp32) or safetensors (collective).

        Without pipelining the file is streamed one full parameter at a time, so no rank holds
        more than the largest parameter: ZeRO 1-3 fetch the fp32 master weights
        (deepspeed.utils.safe_get_full_fp32_param, a collective per parameter); ZeRO-3 with the
        optimizer on NVMe (whose fp32 partitions live in swap files) and ZeRO-0 write the module's
        own weights. The pipeline engine gathers each stage's weights on rank 0.
        """
        if self.pp > 1:
            full = self._gather_pipeline_state()
            if full is not None:
                write_state_dict(full, Path(path), fmt)
        else:
            # The names the native export writes (get_model_state_dict): every parameter and persistent
            # buffer (DeepSeek-V3's router correction bias), in the module's order.
            state = {name.replace(_WRAPPED, ""): t for name, t in self.engine.module.state_dict(keep_vars=True).items()}
            shapes = {name: tuple(getattr(t, "ds_shape", t.shape)) for name, t in state.items()}
            write_streamed(Path(path), fmt, shapes, lambda name: self._full_tensor(state[name]),
                           writes=dist.get_rank() == 0)
        phase_barrier()  # rank 0 finishes the file alone: not bounded by the collective timeout

    def _full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """One state-dict entry's full value on every rank: a buffer is whole on each rank (ZeRO
        partitions parameters only); a parameter is assembled (collective under ZeRO 1-3)."""
        if not isinstance(tensor, nn.Parameter):
            return tensor.detach()
        return self._full_parameter(tensor)

    def _full_parameter(self, param: torch.Tensor) -> torch.Tensor:
        """One parameter's full value on every rank (collective under ZeRO 1-3)."""
        import deepspeed  # lazy: deepspeed is slow to import (DeepSpeed backend only)
        from deepspeed.utils import safe_get_full_fp32_param  # lazy: as above

        if self.layout.memory.zero_stage == 0:
            return param.detach()
        if self.layout.memory.offload_optimizer == "nvme":
            with deepspeed.zero.GatheredParameters([param]):
                return param.detach().clone()
        full = safe_get_full_fp32_param(param)
        if full is None:  # DeepSpeed linked no fp32 master to this parameter
            raise RuntimeError(f"DeepSpeed ZeRO-{self.layout.memory.zero_stage} holds no fp32 master weight for a "
                               f"parameter of shape {tuple(param.shape)}: the export cannot read it")
        return full

    def _gather_pipeline_state(self) -> Optional[Dict[str, torch.Tensor]]:
        module = self.engine.module
        local: Dict[str, torch.Tensor] = {}
        if self.engine.grid.get_data_parallel_rank() == 0:
            for name, t in module.state_dict().items():
                local[_pipeline_name(name, self.n_blocks)] = t
        local = canonical_state_dict(local)
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(local, gathered, dst=0)
        if gathered is None:
            return None
        full: Dict[str, torch.Tensor] = {}
        for part in gathered:
            full.update(part)
        return full
