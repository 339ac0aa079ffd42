"""Tensor parallelism (Megatron-style, with DTensor) and sequence parallelism for the decoder.

Plan per block: wq/wk/wv and w1/w3 column-wise (each rank owns n_heads/tp query heads,
n_kv_heads/tp kv heads and ffn_dim/tp hidden units), wo and w2 row-wise (one all-reduce,
or reduce-scatter under SP, per sub-layer). The embedding is row-wise (vocab-sharded) and
the output layer column-wise with vocab-sharded logits, consumed by ``loss_parallel`` so
the full [tokens, vocab] logits are never gathered.

Sequence parallelism (``parallel.sp``): norms and residuals hold a 1/tp slice of the
sequence; the inputs of attention and MLP are all-gathered, their outputs reduce-scattered.

MoE blocks: router and experts are replicated over the TP ranks (each rank computes the
whole MoE on the full sequence; shard experts with ``parallel.ep`` instead). Under SP the
MoE input is all-gathered and its output sliced back to the local sequence shard.

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
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

log = logging.getLogger(__name__)


def check_tensor_parallel(cfg, tp: int) -> None:
    """Raise ValueError naming every shape that does not divide by ``tp`` (the validator's rule,
    launcher.config.validate.tensor_parallel_problems, written once)."""
    from launcher.config.validate import tensor_parallel_problems

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
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

        return Float8ColwiseParallel, Float8RowwiseParallel
    return ColwiseParallel, RowwiseParallel


def _float8_tensorwise(module: nn.Module) -> bool:
    """A Float8Linear with tensorwise scaling of its input: what torchao's float8 TP styles and
    PrepareFloat8ModuleInput assume (one scale per tensor survives a sharded all-gather)."""
    if type(module).__name__ != "Float8Linear":
        return False
    from torchao.float8.config import ScalingGranularity

    return module.config.cast_config_input.scaling_granularity == ScalingGranularity.TENSORWISE


def _prepare_input(block: nn.Module, path: str, users: tuple, fp8: bool, **kw):
    """The SP all-gather of a sub-layer's input (`path`, e.g. attention): torchao's
    PrepareFloat8ModuleInput when every linear that reads it (`users`) is a tensorwise Float8Linear,
    so the input is cast to float8 once, before the gather (half the bytes of bf16 on the wire)."""
    module = block.get_submodule(path)
    if fp8 and all(_float8_tensorwise(module.get_submodule(u)) for u in users):
        from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

        return PrepareFloat8ModuleInput(fwd_config_submodule_fqn=users[0], **kw)
    return PrepareModuleInput(**kw)


def _col(block: nn.Module, path: str, fp8: bool, **kw):
    return _styles(block.get_submodule(path), fp8)[0](**kw)


def _row(block: nn.Module, path: str, fp8: bool, **kw):
    return _styles(block.get_submodule(path), fp8)[1](**kw)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool,
                          loss_parallel: bool = True, float8_comms: Optional[bool] = None) -> nn.Module:
    """Shard ``model`` (a whole model or one pipeline stage) over ``tp_mesh`` in place.

    Linears already converted to float8 (launcher.parallel.fp8, applied before TP) get
    torchao's float8 column/row-wise styles; the embedding and output layer stay high
    precision. float8_comms (default: off on CPU, where gloo has no float8 collectives) picks the
    float8 styles (block_plan); a test on a fake process group sets it on CPU.
    """
    check_tensor_parallel(model.cfg, tp_mesh.size())
    fp8 = tp_mesh.device_type != "cpu" if float8_comms is None else float8_comms
    seq = Shard(1) if sequence_parallel else Replicate()
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
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

    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(block, sequence_parallel=sequence_parallel, float8_comms=fp8))
    log.info("applied tensor parallelism (tp=%d) to %d blocks, sequence_parallel=%s, loss_parallel=%s",
             tp_mesh.size(), len(model.layers), sequence_parallel, loss_parallel)
    return model


def block_plan(block: nn.Module, *, sequence_parallel: bool, float8_comms: bool) -> dict:
    """The parallelize_module plan of one decoder block (sub-module path -> ParallelStyle).

    float8_comms: tensorwise Float8Linears get torchao's float8 styles, and under SP the inputs of
    attention and MLP are all-gathered in float8 (PrepareFloat8ModuleInput); false on CPU (gloo
    has no float8 collectives).
    """
    fp8 = float8_comms
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "attention.wq": _col(block, "attention.wq", fp8),
        "attention.wk": _col(block, "attention.wk", fp8),
        "attention.wv": _col(block, "attention.wv", fp8),
        "attention.wo": _row(block, "attention.wo", fp8, output_layouts=seq),
    }
    if sequence_parallel:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
        plan["attention"] = _prepare_input(block, "attention", ("wq", "wk", "wv"), fp8,
                                           input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
    if block.is_moe:
        if sequence_parallel:
            # Gather the sequence for routing, slice the output back to this rank's part.
            plan["moe"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                use_local_input=True, output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),), use_local_output=True)
    else:
        plan.update({
            "feed_forward.w1": _col(block, "feed_forward.w1", fp8),
            "feed_forward.w3": _col(block, "feed_forward.w3", fp8),
            "feed_forward.w2": _row(block, "feed_forward.w2", fp8, output_layouts=seq),
        })
        if sequence_parallel:
            plan["feed_forward"] = _prepare_input(block, "feed_forward", ("w1", "w3"), fp8,
                                                  input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan
