"""fp8 + tensor and sequence parallelism: the SP all-gathers of the attention and MLP inputs run
in float8 (torchao's PrepareFloat8ModuleInput), the linears use torchao's float8 TP styles.

gloo has no float8 collectives, so a real run on CPU keeps the plain styles (launcher/parallel/tp.py);
these tests build the plan with float8 comms forced on, and run it on torch's fake process group
(2 ranks in one process: real DTensor sharding and dispatch, collectives that move no data).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from launcher.config.loader import compose_spec
from launcher.config.schema import Fp8Config
from launcher.models import build_model
from launcher.parallel.fp8 import convert_to_float8
from launcher.models.llama.tp import block_plan
from launcher.parallel.tp import BlockStyles
from launcher.parallel.tp import apply_tensor_parallel

torchao_tp = pytest.importorskip("torchao.float8.float8_tensor_parallel")


def _float8_model(recipe: str = "tensorwise"):
    torch.manual_seed(0)
    model = build_model(compose_spec(["+recipe=debug"]).model)
    convert_to_float8(model, Fp8Config(recipe=recipe, emulate=True), device_type="cpu", fsdp_enabled=False)
    return model


def test_fp8_sp_plan_gathers_inputs_in_float8_with_float8_styles():
    block = _float8_model().layers["0"]
    plan = block_plan(block, BlockStyles(block, True), sequence_parallel=True)
    for name, users in (("attention", "wq"), ("feed_forward", "w1")):
        assert type(plan[name]) is torchao_tp.PrepareFloat8ModuleInput, name
        assert plan[name].fwd_config_submodule_fqn == users
    for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
        assert type(plan[name]) is torchao_tp.Float8ColwiseParallel, name
    for name in ("attention.wo", "feed_forward.w2"):
        assert type(plan[name]) is torchao_tp.Float8RowwiseParallel, name

    # Without float8 comms (CPU/gloo), or with rowwise scaling (one scale per row does not survive a
    # gather of sequence shards), the inputs are gathered in high precision by the plain style.
    plain = block_plan(block, BlockStyles(block, False), sequence_parallel=True)
    assert type(plain["attention"]) is PrepareModuleInput and type(plain["feed_forward"]) is PrepareModuleInput
    assert type(plain["attention.wq"]) is ColwiseParallel and type(plain["attention.wo"]) is RowwiseParallel
    rowwise_block = _float8_model("rowwise").layers["0"]
    rowwise = block_plan(rowwise_block, BlockStyles(rowwise_block, True), sequence_parallel=True)
    assert type(rowwise["attention"]) is PrepareModuleInput and type(rowwise["feed_forward"]) is PrepareModuleInput
    assert "attention" not in block_plan(block, BlockStyles(block, True), sequence_parallel=False)


def test_fp8_sp_step_runs_and_attention_and_mlp_receive_float8_gathered_inputs(fake_two_ranks):
    """Forward + backward of the fp8 + TP + SP model on 2 (fake) ranks: what the attention and MLP
    receive after their input preparation is a replicated DTensor of float8 data, i.e. the
    Shard(1) -> Replicate all-gather moved float8."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    model = _float8_model()
    apply_tensor_parallel(model, fake_two_ranks, sequence_parallel=True, loss_parallel=False, float8_comms=True)
    received = {}

    def record(name):
        def hook(module, args):
            x = args[0]
            received[name] = (type(x._local_tensor) if hasattr(x, "_local_tensor") else type(x), x.placements)
        return hook

    for i, block in model.layers.items():
        block.attention.register_forward_pre_hook(record(f"{i}.attention"))
        block.feed_forward.register_forward_pre_hook(record(f"{i}.feed_forward"))
    logits = model(torch.randint(0, 256, (2, 16)))
    logits.float().sum().backward()
    assert len(received) == 2 * len(model.layers)
    for name, (local_type, placements) in received.items():
        assert local_type is Float8TrainingTensor and [str(p) for p in placements] == ["R"], (name, local_type, placements)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
