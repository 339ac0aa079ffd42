"""Communication volumes, placement, pipeline bubble, step time and MFU."""

from __future__ import annotations

import dataclasses

import pytest

from launcher.config.loader import compose_spec
from launcher.plan.layout import Layout
from launcher.plan.params import model_shape, stage_params
from launcher.plan.perf import bubble_fraction, estimate_comm, estimate_time, placement, ring_factor

HW = compose_spec([]).hardware  # h100_sxm
SHAPE = model_shape(compose_spec(["model=llama3_8b"]).model)


def test_ring_factors():
    assert ring_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert ring_factor("reduce_scatter", 8) == pytest.approx(7 / 8)
    assert ring_factor("all_gather", 4) == pytest.approx(3 / 4)
    assert ring_factor("all_to_all", 2) == pytest.approx(1 / 2)
    assert ring_factor("all_reduce", 1) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        ring_factor("broadcast", 2)


def test_bubble_formulas():
    assert bubble_fraction(Layout(pp=4, microbatches=8, schedule="1f1b")) == pytest.approx(3 / 8)  # (p-1)/m
    assert bubble_fraction(Layout(pp=4, microbatches=8, schedule="gpipe")) == pytest.approx(3 / 8)
    inter = Layout(pp=4, vpp=2, microbatches=8, schedule="interleaved_1f1b")
    assert bubble_fraction(inter) == pytest.approx(3 / (2 * 8))  # (p-1)/(v m)
    assert bubble_fraction(Layout(pp=1, microbatches=8)) == 0.0
    assert bubble_fraction(Layout(pp=4, vpp=2, microbatches=8, schedule="zbv")) < bubble_fraction(inter)


def test_tp_is_intra_node_and_pp_crosses_nodes():
    lay = Layout(pp=4, dp_shard=2, tp=8, gpus_per_node=8)
    assert placement(lay, ("tp",)) == "intra"
    assert placement(lay, ("dp_shard", "cp")) == "inter"
    assert placement(lay, ("pp",)) == "inter"
    small = Layout(dp_shard=2, tp=4, gpus_per_node=8)
    assert placement(small, ("dp_shard", "cp")) == "intra"  # 2 x 4 ranks fit in one node


def test_zero3_moves_1_5x_the_bytes_of_ddp():
    st = stage_params(SHAPE, 1)[0]
    # Same dtype for gathers and reductions so the ratio is the textbook one.
    base = Layout(dp_shard=8, microbatches=1, reduce_dtype="bf16", precision="bf16", gpus_per_node=8)
    ddp = sum(c.bytes_per_step for c in estimate_comm(SHAPE, dataclasses.replace(base, zero_stage=0), HW, st))
    z3 = sum(c.bytes_per_step for c in estimate_comm(SHAPE, dataclasses.replace(base, zero_stage=3), HW, st))
    assert ddp == pytest.approx(2 * 7 / 8 * st.shared * 2)  # ring all-reduce of bf16 grads
    assert z3 / ddp == pytest.approx(1.5)


def test_tp_volume_by_hand():
    st = stage_params(SHAPE, 1)[0]
    lay = Layout(tp=4, sp=True, microbatches=2, seq_len=2048, micro_batch_size=1, zero_stage=0)
    comm = {c.name: c for c in estimate_comm(SHAPE, lay, HW, st)}
    # Per block per micro-batch: 2 all-gathers forward + 2 backward of s*b*h*2 bytes, (t-1)/t each.
    expected = 32 * 2 * 4 * 2048 * 4096 * 2 * 3 / 4
    assert comm["TP all-gather (SP)"].bytes_per_step == pytest.approx(expected)
    assert comm["TP all-gather (SP)"].where == "intra"


def test_step_time_and_mfu_are_consistent():
    lay = Layout(dp_shard=64, tp=1, microbatches=2, seq_len=8192, micro_batch_size=1, gpus_per_node=8)
    flops_tok = 6 * SHAPE.total  # any consistent number
    tokens = 64 * 2 * 8192
    t = estimate_time(SHAPE, lay, HW, flops_tok, tokens)
    assert t["step_s"] >= t["compute_s"] > 0
    assert t["tokens_per_s_per_gpu"] == pytest.approx(tokens / t["step_s"] / 64)
    assert t["mfu"] == pytest.approx(t["tokens_per_s_per_gpu"] * flops_tok / 989e12)
    assert 0 < t["mfu"] < HW.achievable_fraction  # can never beat the assumed achievable fraction
    # Full recomputation adds a forward: slower.
    slow = estimate_time(SHAPE, dataclasses.replace(lay, ac_mode="full"), HW, flops_tok, tokens)
    assert slow["compute_s"] == pytest.approx(t["compute_s"] * 4 / 3, rel=0.02)


@pytest.mark.parametrize("name", ["h100_sxm", "h200", "a100_80gb", "b200", "h100_hbm2e_500w"])
def test_hardware_catalogue(name):
    hw = compose_spec([f"hardware={name}"]).hardware
    assert hw.name == name
    assert hw.memory_gb >= 80 and hw.bf16_tflops > 0 and hw.hbm_gbps > 0
    assert 0 < hw.tf32_tflops <= hw.bf16_tflops / 2 + 1  # TF32 tensor cores: half the BF16 rate
    assert hw.nvlink_gbps > hw.network_gbps > 0
    assert hw.fp8_supported == (name != "a100_80gb")  # A100 has no FP8 tensor cores


def test_faster_gpu_gives_a_faster_step():
    lay = Layout(dp_shard=8, tp=1, microbatches=4, seq_len=4096, gpus_per_node=8)
    times = {}
    for name in ("a100_80gb", "h100_sxm", "b200"):
        hw = compose_spec([f"hardware={name}"]).hardware
        times[name] = estimate_time(SHAPE, lay, hw, 6 * SHAPE.total, 8 * 4 * 4096)["step_s"]
    assert times["a100_80gb"] > times["h100_sxm"] > times["b200"]
