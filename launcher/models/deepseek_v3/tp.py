"""Tensor-parallel plan of one DeepSeek-V3 block (MLA attention, dense FFN or MoE).

Heads are sharded: wq (or wq_b) and wkv_b column-wise (each rank owns n_heads/tp query heads and
their key/value heads), wo row-wise. The low-rank down-projections wq_a and wkv_a and their norms
q_norm / kv_norm stay replicated plain modules: their input is the whole (under SP, gathered)
hidden state and every column-wise layer behind them sums its input gradient over the TP ranks.
The one path that reaches the replicated part around a column-wise layer is the shared RoPE key
(each rank uses it for its own heads only): `attention.rope_key` (an identity) sums its gradient
over the TP ranks. Dense FFN and MoE as Llama's plan (launcher/models/llama/tp.py).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import PrepareModuleInput
from torch.distributed.tensor.parallel.style import ParallelStyle

from launcher.models.llama.tp import norms_and_ffn_plan


class SumGradOverTP(ParallelStyle):
    """Identity forward on a module's tensor inputs; backward sums their gradients over the TP mesh
    (for a replicated tensor consumed differently by each rank's shard)."""

    def _apply(self, module: nn.Module, device_mesh):
        def input_fn(mod, inputs, mesh):
            return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
                         for t in inputs)

        return distribute_module(module, device_mesh, input_fn=input_fn)


def block_plan(block: nn.Module, styles, *, sequence_parallel: bool) -> dict:
    """The parallelize_module plan of one DeepSeek-V3 block (sub-module path -> ParallelStyle)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    attn = block.attention
    q = "attention.wq_b" if hasattr(attn, "wq_b") else "attention.wq"
    plan = {
        q: styles.colwise(q),
        "attention.wkv_b": styles.colwise("attention.wkv_b"),
        "attention.wo": styles.rowwise("attention.wo", output_layouts=seq),
        "attention.rope_key": SumGradOverTP(),
    }
    if sequence_parallel:
        # Local output: the replicated down-projections take plain tensors.
        plan["attention"] = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
                                               use_local_output=True)
    plan.update(norms_and_ffn_plan(block, styles, sequence_parallel=sequence_parallel))
    return plan
