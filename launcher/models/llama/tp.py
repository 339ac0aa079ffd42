"""Tensor-parallel plan of one Llama-style decoder block (also Mixtral's and Qwen3's).

wq/wk/wv and w1/w3 column-wise (each rank owns n_heads/tp query heads, n_kv_heads/tp kv heads
and ffn_dim/tp hidden units), wo and w2 row-wise (one all-reduce, or reduce-scatter under SP,
per sub-layer). MoE blocks, experts folded over TP (styles.fold_experts, the default): each TP
rank runs the MoE on its own 1/tp of the sequence (under SP the slice it holds; without SP its
slice is cut from the replicated input and the outputs are all-gathered back), the router and
shared experts replicated DTensors whose gradients are summed over TP, the routed experts spread
over the expert-parallel ranks (launcher/parallel/ep.py). Replicated (fold_experts=False, kept for
the benchmark): every TP rank runs the whole MoE on the full sequence. QK-norm
(Qwen3): the per-head norm weights are replicated DTensors applied to the head-sharded q/k, so
their gradients are summed over the TP ranks (each rank sees only its heads).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInputOutput, SequenceParallel


def block_plan(block: nn.Module, styles, *, sequence_parallel: bool) -> dict:
    """The parallelize_module plan of one decoder block (sub-module path -> ParallelStyle).

    styles: launcher.parallel.tp.BlockStyles bound to this block (column-/row-wise linears and SP
    input gathers, in float8 where the linears are Float8Linears and the comms allow it).
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "attention.wq": styles.colwise("attention.wq"),
        "attention.wk": styles.colwise("attention.wk"),
        "attention.wv": styles.colwise("attention.wv"),
        "attention.wo": styles.rowwise("attention.wo", output_layouts=seq),
    }
    if getattr(block.attention, "q_norm", None) is not None:
        # q/k arrive [b, s, local heads, head_dim]: "sequence" dim 2 is the head dim TP shards.
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if sequence_parallel:
        plan["attention"] = styles.prepare_input("attention", ("wq", "wk", "wv"),
                                                 input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
    plan.update(norms_and_ffn_plan(block, styles, sequence_parallel=sequence_parallel))
    return plan


def norms_and_ffn_plan(block: nn.Module, styles, *, sequence_parallel: bool) -> dict:
    """The block's plan outside attention, shared by every family with this block layout (RMSNorms
    before attention and FFN; a SwiGLU FFN or an MoE): SP norms, the FFN column-/row-wise, and
    under SP the MoE's sequence gathered for routing and its output sliced back."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {}
    if sequence_parallel:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    if block.is_moe and getattr(styles, "fold_experts", True):
        plan.update(folded_moe_plan(block, sequence_parallel=sequence_parallel))
    elif block.is_moe:
        if sequence_parallel:
            # Gather the sequence for routing, slice the output back to this rank's part.
            plan["moe"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                use_local_input=True, output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),), use_local_output=True)
    else:
        plan.update({
            "feed_forward.w1": styles.colwise("feed_forward.w1"),
            "feed_forward.w3": styles.colwise("feed_forward.w3"),
            "feed_forward.w2": styles.rowwise("feed_forward.w2", output_layouts=seq),
        })
        if sequence_parallel:
            plan["feed_forward"] = styles.prepare_input("feed_forward", ("w1", "w3"),
                                                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def folded_moe_plan(block: nn.Module, *, sequence_parallel: bool) -> dict:
    """An MoE whose experts are folded over TP: every TP rank routes its own 1/tp of the sequence.

    Under SP the MoE takes the slice the rank holds and returns its slice (no communication).
    Without SP its input is replicated: the rank keeps its 1/tp of the sequence (a local slice;
    backward all-gathers the input's gradient) and the outputs are all-gathered (backward keeps
    the rank's slice of the gradient). The router and the shared experts compute on those tokens
    with weights replicated over TP (SequenceParallel over the flattened tokens, dim 0): their
    gradients arrive Partial and are summed over TP. Shared experts stay replicated rather than
    TP-sharded: the same FLOPs per rank (1/tp of the tokens through whole weights), and no
    all-gather / reduce-scatter of the tokens, which TP-sharding them would need (docs/parallelism.md).
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "moe": PrepareModuleInputOutput(
            input_layouts=(seq,), desired_input_layouts=(Shard(1),), use_local_input=True,
            output_layouts=(Shard(1),), desired_output_layouts=(seq,), use_local_output=True),
    }
    # Each linear on its own (SequenceParallel replicates a module's direct parameters only).
    shared = ("moe.shared_experts.w1", "moe.shared_experts.w2", "moe.shared_experts.w3") \
        if block.moe.shared_experts is not None else ()
    for path in ("moe.router",) + shared:
        plan[path] = SequenceParallel(sequence_dim=0, use_local_output=True)
    return plan
