"""Tensor parallelism (Megatron-style, with DTensor) and sequence parallelism for the decoder.

This module applies the plan and holds the styles every family's plan is made of; the plan of
one block is the family's (launcher/models/<family>/tp.py). Llama's plan per block: wq/wk/wv and w1/w3 column-wise (each rank owns n_heads/tp query heads,
n_kv_heads/tp kv heads and ffn_dim/tp hidden units), wo and w2 row-wise (one all-reduce,
or reduce-scatter under SP, per sub-layer). The embedding is row-wise (vocab-sharded) and
the output layer column-wise with vocab-sharded logits, consumed by ``loss_parallel`` so
the full [tokens, vocab] logits are never gathered.

Sequence parallelism (``parallel.sp``): norms and residuals hold a 1/tp slice of the
sequence; the inputs of attention and MLP are all-gathered, their outputs reduce-scattered.

MoE blocks: experts folded over TP (``fold_experts``, the Layout's ``experts_folded``): each
TP rank routes only its own 1/tp of the sequence (its SP slice, or without SP a slice cut from
its replicated input, the outputs all-gathered back); the router and shared experts are
replicated over TP with gradients summed over TP, and the routed experts are spread over the
expert-parallel ranks, which may include the TP ranks (launcher/parallel/ep.py). With
``fold_experts=False`` (the replicated MoE, kept for bench/moe_fold.py) each rank computes the
whole MoE on the full sequence; under SP its input is all-gathered and the output sliced back.

GQA: every TP rank needs whole kv heads, so n_kv_heads must be a multiple of tp; a smaller
n_kv_heads is refused (replicating kv heads would change the checkpoint layout).
"""

from __future__ import annotations

import logging
from typing import Optional

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from launcher.config.validate import tensor_parallel_problems
from launcher.models.family import family_of
from launcher.models.mtp import mtp_blocks

log = logging.getLogger(__name__)


def check_tensor_parallel(cfg, tp: int) -> None:
    """Raise ValueError naming every shape that does not divide by ``tp`` (the validator's rule,
    launcher.config.validate.tensor_parallel_problems, written once)."""
    problems = tensor_parallel_problems(cfg, tp)
    if problems:
        raise ValueError("tensor parallelism cannot split this model:\n  " + "\n  ".join(problems))


def _styles(module: nn.Module, float8_comms: bool):
    """(colwise, rowwise) style classes for a linear: torchao's float8 ones for Float8Linear,
    so the fp8 casts happen on the local shards (and SP all-gathers move fp8 data).

    gloo has no float8 collectives ("Invalid scalar type"), so on CPU a Float8Linear keeps
    the plain styles: it still computes in (emulated) fp8, its communication stays bf16/fp32.
    """
    if float8_comms and type(module).__name__ == "Float8Linear":
        # lazy: torchao is slow to import (~0.6 s); only fp8 runs use it
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

        return Float8ColwiseParallel, Float8RowwiseParallel
    return ColwiseParallel, RowwiseParallel


def _float8_tensorwise(module: nn.Module) -> bool:
    """A Float8Linear with tensorwise scaling of its input: what torchao's float8 TP styles and
    PrepareFloat8ModuleInput assume (one scale per tensor survives a sharded all-gather)."""
    if type(module).__name__ != "Float8Linear":
        return False
    # lazy: torchao is slow to import (~0.6 s); only fp8 runs use it
    from torchao.float8.config import ScalingGranularity

    return module.config.cast_config_input.scaling_granularity == ScalingGranularity.TENSORWISE


class BlockStyles:
    """The parallel styles a family's block plan is made of, bound to one block.

    A family's plan (launcher/models/<family>/tp.py) names which sub-modules are column-wise,
    row-wise or gather their input; these methods turn that into torch's styles, or torchao's
    float8 ones where the linear is a Float8Linear and float8_comms is on, so the model layer
    needs nothing from this package.
    """

    def __init__(self, block: nn.Module, float8_comms: bool, fold_experts: bool = True):
        self.block = block
        self.float8_comms = float8_comms
        # MoE blocks: each TP rank routes its own tokens (launcher/models/llama/tp.py folded_moe_plan).
        self.fold_experts = fold_experts

    def colwise(self, path: str, **kw):
        """ColwiseParallel (or torchao's float8 one) for the linear at `path`."""
        return _styles(self.block.get_submodule(path), self.float8_comms)[0](**kw)

    def rowwise(self, path: str, **kw):
        """RowwiseParallel (or torchao's float8 one) for the linear at `path`."""
        return _styles(self.block.get_submodule(path), self.float8_comms)[1](**kw)

    def prepare_input(self, path: str, users: tuple, **kw):
        """The SP all-gather of a sub-layer's input (`path`, e.g. attention): torchao's
        PrepareFloat8ModuleInput when every linear that reads it (`users`) is a tensorwise
        Float8Linear, so the input is cast to float8 once, before the gather (half the bytes of
        bf16 on the wire)."""
        module = self.block.get_submodule(path)
        if self.float8_comms and all(_float8_tensorwise(module.get_submodule(u)) for u in users):
            # lazy: torchao is slow to import (~0.6 s); only fp8 runs use it
            from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

            return PrepareFloat8ModuleInput(fwd_config_submodule_fqn=users[0], **kw)
        return PrepareModuleInput(**kw)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool,
                          loss_parallel: bool = True, float8_comms: Optional[bool] = None,
                          fold_experts: bool = True) -> nn.Module:
    """Shard ``model`` (a whole model or one pipeline stage) over ``tp_mesh`` in place.

    Linears already converted to float8 (launcher.parallel.fp8, applied before TP) get
    torchao's float8 column/row-wise styles; the embedding and output layer stay high
    precision. float8_comms (default: off on CPU, where gloo has no float8 collectives) picks the
    float8 styles (the family's block_plan); a test on a fake process group sets it on CPU.
    Each decoder block gets its family's plan (launcher/models/<family>/tp.py); fold_experts:
    MoE blocks route each TP rank's own tokens (else every rank runs the whole MoE).
    """
    check_tensor_parallel(model.cfg, tp_mesh.size())
    fp8 = tp_mesh.device_type != "cpu" if float8_comms is None else float8_comms
    seq = Shard(1) if sequence_parallel else Replicate()
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if getattr(model, "mtp_embeddings", None) is not None:  # a pipeline's last stage: sharded as the original
        top["mtp_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top:
        parallelize_module(model, tp_mesh, top)

    block_plan = family_of(model.cfg).tp_block_plan()
    blocks = list(model.layers.values()) + mtp_blocks(model)
    for block in blocks:
        parallelize_module(block, tp_mesh, block_plan(block, BlockStyles(block, fp8, fold_experts),
                                                         sequence_parallel=sequence_parallel))
    if sequence_parallel and getattr(model, "mtp", None) is not None:
        for depth in model.mtp.values():
            parallelize_module(depth, tp_mesh, mtp_depth_plan())
    log.info("applied tensor parallelism (tp=%d) to %d blocks (%d of them multi-token prediction's), "
             "sequence_parallel=%s, loss_parallel=%s, experts %s", tp_mesh.size(), len(blocks),
             len(blocks) - len(model.layers), sequence_parallel, loss_parallel,
             "folded (each TP rank routes its own tokens)" if fold_experts else "replicated")
    return model


def mtp_depth_plan() -> dict:
    """Under SP, the plan of one multi-token-prediction depth outside its block (launcher/models/mtp.py):
    enorm, hnorm and head_norm as the main norms, and eh_proj too: a per-token map, so it stays
    replicated and each rank projects its own slice of the sequence (1/tp of its FLOPs, no
    activation traffic; its weight's gradient is summed over TP like a norm's). Column/row-sharding
    it would need the whole sequence of both halves of its input gathered and its output
    reduce-scattered, for a [2*dim, dim] matrix that is small next to the block. Its output is a
    local tensor, as the block's residual stream is. Without SP all four are plain replicated
    modules on the replicated hidden state, as the main norms are."""
    return {"enorm": SequenceParallel(), "hnorm": SequenceParallel(), "head_norm": SequenceParallel(),
            "eh_proj": SequenceParallel(use_local_output=True)}
