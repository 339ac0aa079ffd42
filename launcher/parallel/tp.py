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


def _col(block: nn.Module, path: str, fp8: bool, **kw):
    return _styles(block.get_submodule(path), fp8)[0](**kw)


def _row(block: nn.Module, path: str, fp8: bool, **kw):
    return _styles(block.get_submodule(path), fp8)[1](**kw)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool,
                          loss_parallel: bool = True) -> nn.Module:
    """Shard ``model`` (a whole model or one pipeline stage) over ``tp_mesh`` in place.

    Linears already converted to float8 (launcher.parallel.fp8, applied before TP) get
    torchao's float8 column/row-wise styles; the embedding and output layer stay high
    precision.
    """
    check_tensor_parallel(model.cfg, tp_mesh.size())
    fp8 = tp_mesh.device_type != "cpu"
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
        plan = {
            "attention.wq": _col(block, "attention.wq", fp8),
            "attention.wk": _col(block, "attention.wk", fp8),
            "attention.wv": _col(block, "attention.wv", fp8),
            "attention.wo": _row(block, "attention.wo", fp8, output_layouts=seq),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
            plan["attention"] = PrepareModuleInput(
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
                plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                          desired_input_layouts=(Replicate(),))
        parallelize_module(block, tp_mesh, plan)
    log.info("applied tensor parallelism (tp=%d) to %d blocks, sequence_parallel=%s, loss_parallel=%s",
             tp_mesh.size(), len(model.layers), sequence_parallel, loss_parallel)
    return model
