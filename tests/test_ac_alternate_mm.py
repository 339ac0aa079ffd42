"""activation_checkpointing.selective=op_alternate_mm: torchtitan's op-level selective AC.

One forward+backward of the debug model on CPU per policy, counting the matmuls that run:
the alternate policy must recompute exactly wk, wo and w3 of every block (the 2nd, 4th and 6th
mm) and give the same loss and gradients as no checkpointing. The planner's memory formula must
take exactly those three outputs out of what "op" keeps.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode

from launcher.config.schema import ModelConfig
from launcher.models import build_model
from launcher.parallel.ac import apply_activation_checkpointing
from launcher.plan.layout import Layout, MemoryPlan, NumericsPlan, RankBatchPlan
from launcher.plan.degrees import MeshPlan
from launcher.plan.estimate.memory import layer_activation_bytes
from launcher.plan.estimate.params import model_shape

REPO = Path(__file__).resolve().parents[1]
B, S = 2, 16


class _MmShapes(TorchDispatchMode):
    """Output shapes of every aten.mm that runs."""

    def __init__(self):
        super().__init__()
        self.shapes = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func == torch.ops.aten.mm.default:
            self.shapes[tuple(out.shape)] += 1
        return out


def _cfg() -> ModelConfig:
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(REPO / "conf" / "model" / "debug.yaml"))
    return OmegaConf.to_object(cfg)


def _run(cfg, mode: str, selective: str, tokens):
    with torch.device("meta"):
        m = build_model(cfg)
    m.to_empty(device="cpu")
    m.init_weights(0)
    apply_activation_checkpointing(m, mode, selective)
    counter = _MmShapes()
    with counter:
        logits = m(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone() for n, p in m.named_parameters()}
    return loss.detach(), grads, counter.shapes


def test_alternate_mm_recomputes_wk_wo_w3_and_matches_no_ac():
    cfg = _cfg()
    tokens = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    ref_loss, ref_grads, ref_mm = _run(cfg, "none", "op", tokens)
    op_loss, _, op_mm = _run(cfg, "selective", "op", tokens)
    alt_loss, alt_grads, alt_mm = _run(cfg, "selective", "op_alternate_mm", tokens)
    assert op_mm == ref_mm, "op-level selective AC recomputes no matmul"
    kv_dim = cfg.n_kv_heads * cfg.dim // cfg.n_heads
    rows = B * S
    recomputed = alt_mm - op_mm
    assert recomputed == Counter({(rows, kv_dim): cfg.n_layers, (rows, cfg.dim): cfg.n_layers,
                                  (rows, cfg.ffn_dim): cfg.n_layers}), recomputed
    assert not op_mm - alt_mm
    assert torch.equal(op_loss, ref_loss) and torch.equal(alt_loss, ref_loss)
    assert alt_grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(alt_grads[name], g, rtol=0, atol=1e-6, msg=name)


def test_planner_drops_exactly_the_recomputed_outputs():
    shape = model_shape(_cfg())
    for tp, sp in ((1, False), (2, False), (2, True)):
        lay = Layout(batch=RankBatchPlan(micro_batch_size=B, seq_len=S), mesh=MeshPlan(tp=tp), sp=sp, numerics=NumericsPlan(precision="bf16"))
        tokens, a = B * S, lay.act_bytes
        op = layer_activation_bytes(shape, lay, False, "op")
        alt = layer_activation_bytes(shape, lay, False, "op_alternate_mm")
        # wk and w3 outputs are TP-sharded; wo's mm output is the block's attention output without
        # TP (dim per token), while under TP the saved collective output stays either way.
        wo = shape.dim if tp == 1 else 0
        assert op - alt == tokens * a * (shape.kv_dim / tp + shape.ffn_dim / tp + wo), (tp, sp)


def test_planner_times_the_recomputed_matmuls():
    from launcher.config.schema import HardwareConfig
    from launcher.plan.estimate.params import stage_params
    from launcher.plan.estimate.perf import gemm_efficiency, matmul_peak, microbatch_compute_s

    shape, hw = model_shape(_cfg()), HardwareConfig()
    lay = Layout(batch=RankBatchPlan(micro_batch_size=B, seq_len=S), memory=MemoryPlan(ac_mode="selective", ac_selective="op"), numerics=NumericsPlan(precision="bf16"))
    alt = Layout(batch=RankBatchPlan(micro_batch_size=B, seq_len=S), memory=MemoryPlan(ac_mode="selective", ac_selective="op_alternate_mm"), numerics=NumericsPlan(precision="bf16"))
    st = stage_params(shape, 1, 1, "1f1b", ())[0]
    extra = microbatch_compute_s(shape, st, alt, hw) - microbatch_compute_s(shape, st, lay, hw)
    # One more forward of wk, wo and w3 per block: 2 FLOPs per multiply-add of their weights.
    flops = 2 * B * S * shape.n_layers * shape.dim * (shape.kv_dim + shape.dim + shape.ffn_dim)
    peak = matmul_peak(hw, "bf16") * hw.achievable_fraction * gemm_efficiency(shape, lay)
    assert extra == pytest.approx(flops / peak, rel=1e-9)
