"""Communication volumes, placement, pipeline bubble, step time and MFU."""

from __future__ import annotations

import dataclasses

import pytest

from launcher.config.loader import compose_spec
from launcher.plan.layout import Layout, MemoryPlan, NumericsPlan, RankBatchPlan
from launcher.plan.degrees import MeshPlan
from launcher.plan.estimate.params import model_shape, stage_params
from launcher.plan.estimate.perf import bubble_fraction, estimate_comm, estimate_time, placement, ring_factor

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
    assert bubble_fraction(Layout(mesh=MeshPlan(pp=4), batch=RankBatchPlan(microbatches=8), schedule="1f1b")) == pytest.approx(3 / 8)  # (p-1)/m
    assert bubble_fraction(Layout(mesh=MeshPlan(pp=4), batch=RankBatchPlan(microbatches=8), schedule="gpipe")) == pytest.approx(3 / 8)
    inter = Layout(mesh=MeshPlan(pp=4), vpp=2, batch=RankBatchPlan(microbatches=8), schedule="interleaved_1f1b")
    assert bubble_fraction(inter) == pytest.approx(3 / (2 * 8))  # (p-1)/(v m)
    assert bubble_fraction(Layout(mesh=MeshPlan(pp=1), batch=RankBatchPlan(microbatches=8))) == 0.0
    assert bubble_fraction(Layout(mesh=MeshPlan(pp=4), vpp=2, batch=RankBatchPlan(microbatches=8), schedule="zbv")) < bubble_fraction(inter)


def test_tp_is_intra_node_and_pp_crosses_nodes():
    lay = Layout(mesh=MeshPlan(pp=4, dp_shard=2, tp=8), gpus_per_node=8)
    assert placement(lay, ("tp",)) == "intra"
    assert placement(lay, ("dp_shard", "cp")) == "inter"
    assert placement(lay, ("pp",)) == "inter"
    small = Layout(mesh=MeshPlan(dp_shard=2, tp=4), gpus_per_node=8)
    assert placement(small, ("dp_shard", "cp")) == "intra"  # 2 x 4 ranks fit in one node


def test_zero3_moves_1_5x_the_bytes_of_ddp():
    st = stage_params(SHAPE, 1)[0]
    # Same dtype for gathers and reductions so the ratio is the textbook one.
    base = Layout(mesh=MeshPlan(dp_shard=8), batch=RankBatchPlan(microbatches=1), numerics=NumericsPlan(reduce_dtype="bf16", precision="bf16"), gpus_per_node=8)
    ddp = sum(c.bytes_per_step for c in estimate_comm(SHAPE, dataclasses.replace(base, memory=dataclasses.replace(base.memory, zero_stage=0)), HW, st))
    z3 = sum(c.bytes_per_step for c in estimate_comm(SHAPE, dataclasses.replace(base, memory=dataclasses.replace(base.memory, zero_stage=3)), HW, st))
    assert ddp == pytest.approx(2 * 7 / 8 * st.shared * 2)  # ring all-reduce of bf16 grads
    assert z3 / ddp == pytest.approx(1.5)


def test_tp_volume_by_hand():
    st = stage_params(SHAPE, 1)[0]
    lay = Layout(mesh=MeshPlan(tp=4), sp=True, batch=RankBatchPlan(microbatches=2, seq_len=2048, micro_batch_size=1), memory=MemoryPlan(zero_stage=0))
    comm = {c.name: c for c in estimate_comm(SHAPE, lay, HW, st)}
    # Per block per micro-batch: 2 all-gathers forward + 2 backward of s*b*h*2 bytes, (t-1)/t each.
    expected = 32 * 2 * 4 * 2048 * 4096 * 2 * 3 / 4
    assert comm["TP all-gather (SP)"].bytes_per_step == pytest.approx(expected)
    assert comm["TP all-gather (SP)"].where == "intra"


def test_cp_ring_volume_by_hand():
    """torch's ring attention, as the runtime runs it: K/V repeated to all 32 query heads (not the 8
    K/V heads) gathered once in forward and once in backward, and the fp32 dK/dV sent on after each
    of the cp hops; the merges' bytes grow with the hops at the same tokens per GPU."""
    from launcher.plan.estimate.ring import ring_bookkeeping_s

    st = stage_params(SHAPE, 1)[0]
    lay = Layout(mesh=MeshPlan(cp=4, dp_shard=2), batch=RankBatchPlan(seq_len=8192, micro_batch_size=1, microbatches=1))
    comm = {c.name: c for c in estimate_comm(SHAPE, lay, HW, st)}
    kv = 8192 * 32 * (128 + 128) * 2  # the whole sequence's expanded K and V, bf16
    assert comm["CP K/V ring"].bytes_per_step == pytest.approx(kv * 3 / 4 * 32 * 2)
    assert comm["CP dK/dV ring"].bytes_per_step == pytest.approx(kv / 4 * 2 * 32 * 4)
    # Same 2,048 tokens per GPU: 7 hops cost 7x the bookkeeping of 1 hop, none without CP.
    by_cp = {cp: ring_bookkeeping_s(SHAPE, dataclasses.replace(lay, mesh=dataclasses.replace(lay.mesh, cp=cp), batch=dataclasses.replace(lay.batch, seq_len=2048 * cp)), HW, 32, 0.0, 2048)
             for cp in (1, 2, 8)}
    assert by_cp[1] == 0.0 and by_cp[8] == pytest.approx(7 * by_cp[2])


def test_step_time_and_mfu_are_consistent():
    lay = Layout(mesh=MeshPlan(dp_shard=64, tp=1), batch=RankBatchPlan(microbatches=2, seq_len=8192, micro_batch_size=1), gpus_per_node=8)
    flops_tok = 6 * SHAPE.total  # any consistent number
    tokens = 64 * 2 * 8192
    t = estimate_time(SHAPE, lay, HW, flops_tok, tokens)
    assert t["step_s"] >= t["compute_s"] > 0
    assert t["tokens_per_s_per_gpu"] == pytest.approx(tokens / t["step_s"] / 64)
    assert t["mfu"] == pytest.approx(t["tokens_per_s_per_gpu"] * flops_tok / 989e12)
    assert 0 < t["mfu"] < HW.achievable_fraction  # can never beat the assumed achievable fraction
    # Full recomputation adds a forward: slower.
    slow = estimate_time(SHAPE, dataclasses.replace(lay, memory=dataclasses.replace(lay.memory, ac_mode="full")), HW, flops_tok, tokens)
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
    lay = Layout(mesh=MeshPlan(dp_shard=8, tp=1), batch=RankBatchPlan(microbatches=4, seq_len=4096), gpus_per_node=8)
    times = {}
    for name in ("a100_80gb", "h100_sxm", "b200"):
        hw = compose_spec([f"hardware={name}"]).hardware
        times[name] = estimate_time(SHAPE, lay, hw, 6 * SHAPE.total, 8 * 4 * 4096)["step_s"]
    assert times["a100_80gb"] > times["h100_sxm"] > times["b200"]


def test_family_blocks_in_the_elementwise_time_and_the_assumptions():
    """The elementwise bytes follow the family's attention layout: Qwen3's QK-norm adds an fp32
    RMSNorm over every q and k head (six kernels eager, one read + write compiled); MLA rotates only
    the qk_rope channels (of every query head and the one shared key), builds q and k by
    concatenation, normalises its two latents and routes through DeepSeek-V3's sigmoid router. The
    plan's assumptions line names the family's block."""
    from launcher.plan.estimate.elementwise import block_forward_bytes, router_bytes
    from launcher.plan.present.report import assumptions

    qwen = compose_spec(["model=qwen3_8b"]).model
    plain = dataclasses.replace(qwen, qk_norm=False)
    for compiled, per_elem in ((False, 2 * 2 + 36), (True, 2 * 2)):
        lay = Layout(mesh=MeshPlan(tp=2), compile=compiled, numerics=NumericsPlan(precision="bf16"))
        extra = block_forward_bytes(model_shape(qwen), lay) - block_forward_bytes(model_shape(plain), lay)
        assert extra == pytest.approx(per_elem * (32 + 8) * 128 / 2)

    ds_cfg = compose_spec(["model=deepseek_v3"]).model
    ds = model_shape(ds_cfg)
    lay = Layout(numerics=NumericsPlan(precision="bf16"))
    heads, rope, qk, v = 128, 64, 192, 128
    # Without the family's layout (a Llama block of qk-wide heads) RoPE would rotate all 192
    # channels of 128 query and 128 key heads.
    expected = ((2 * (2 * 2 + 36) * 7168 + 6 * 2 * 7168)  # block norms, residual adds
                + (2 * 2 + 48) * (heads + 1) * rope  # RoPE on q's and the shared key's rope channels
                + 2 * 2 * heads * v  # SDPA output copy for wo
                + 5 * 2 * (8 + 1) * 2048  # SwiGLU over 8 routed + 1 shared experts
                + (2 * 2 + 36) * (1536 + 512)  # q and kv latent norms
                + 2 * 2 * 2 * heads * qk  # q and k concatenated
                + router_bytes(ds, lay) * 58 / 61  # 58 of 61 blocks route
                # their 8 dim-wide rows per token gathered to expert order and combined (eager)
                + (2 * 2 + 16 + 5 * 2) * 8 * 7168 * 58 / 61)
    assert block_forward_bytes(ds, lay) == pytest.approx(expected)
    assert router_bytes(ds, lay) == (2 + 60) * 256  # elementwise.router_bytes docstring
    assert router_bytes(model_shape(compose_spec(["model=mixtral_8x7b"]).model), lay) == 0.0

    assert "DeepSeek-V3 block (MLA 128 heads, q_lora 1536, kv_lora 512, qk 128+64, v 128" in assumptions(ds_cfg)
    assert "Qwen3 block (QK-norm, 32/8 heads x 128" in assumptions(qwen)
    assert "Llama block (GQA 32/8 heads x 128" in assumptions(compose_spec(["model=llama3_8b"]).model)
    assert all("this Llama block" not in assumptions(m) for m in (qwen, ds_cfg))


def test_deepseek_v3_router_bias_update_is_in_the_step():
    """Aux-loss-free balancing all-reduces the [n_layers, n_experts] fp32 loads once per step over
    every rank: 62.5 kB for the 671B model, exposed, microseconds against a step of seconds. Models
    without the bias have no such collective."""
    ds = model_shape(compose_spec(["model=deepseek_v3"]).model)
    lay = Layout(
        mesh=MeshPlan(pp=16, dp_shard=128, ep=64),
        vpp=2,
        schedule="interleaved_1f1b",
        batch=RankBatchPlan(microbatches=32, seq_len=4096),
        gpus_per_node=8,
        nodes=256,
        memory=MemoryPlan(zero_stage=2),
    )
    st = stage_params(ds, 16, 2, "interleaved_1f1b")[0]
    comm = {c.name: c for c in estimate_comm(ds, lay, HW, st)}
    bias = comm["router bias all-reduce"]
    assert bias.group_size == 2048 and bias.where == "inter"
    assert bias.bytes_per_step == pytest.approx(ring_factor("all_reduce", 2048) * 4 * 61 * 256)
    t = estimate_time(ds, lay, HW, 6 * ds.active, 4096 * 4096, ranks=(0,))
    exposed = next(c for c in t["comm"] if c.name == "router bias all-reduce").exposed_s
    assert 0 < exposed < 1e-3 * t["step_s"]
    llama_lay = Layout(mesh=MeshPlan(dp_shard=8), gpus_per_node=8)
    assert not any("router bias" in c.name for c in estimate_comm(SHAPE, llama_lay, HW, stage_params(SHAPE, 1)[0]))


DSV3 = model_shape(compose_spec(["model=deepseek_v3"]).model)


def _ep_layout(ep: int, tp: int = 1, imbalance: float = 1.0) -> Layout:
    """DeepSeek-V3 without a pipeline on 64 ranks per tp (8 per node), one 4,096-token micro-batch."""
    return Layout(mesh=MeshPlan(dp_shard=64, tp=tp, ep=ep), gpus_per_node=8, nodes=8 * tp,
                  batch=RankBatchPlan(micro_batch_size=1, microbatches=1, seq_len=4096),
                  memory=MemoryPlan(zero_stage=2), moe_imbalance=imbalance)


def test_ep_all_to_all_inside_and_across_nodes_by_hand():
    """The runtime's EP all-to-all (launcher/parallel/ep.py): one bf16 dim-wide row per routed copy,
    dispatch and combine in forward and backward (4 per MoE block), 1/ep of the rows per peer. EP 32
    over 4 nodes of 8: 7/32 of the rows go to same-node peers over NVLink, 24/32 to the other nodes
    over the network, at once, so only the slower part is exposed. TP 4 leaves 2 ep ranks per node;
    EP 8 in one node sends nothing over the network. The busiest rank's share scales with
    plan.moe_imbalance."""
    from launcher.plan.estimate.perf import ep_peer_shares

    st = stage_params(DSV3, 1)[0]
    rows = 4096 * 8 * 7168 * 2 * 58 * 4  # tokens x top_k x dim x bf16 x MoE blocks x passes
    comm = {c.name: c for c in estimate_comm(DSV3, _ep_layout(32), HW, st)}
    same, other = comm["EP all-to-all, same-node peers"], comm["EP all-to-all, other nodes"]
    assert (same.where, other.where) == ("intra", "inter")
    assert same.bytes_per_step == pytest.approx(rows * 7 / 32)
    assert other.bytes_per_step == pytest.approx(rows * 24 / 32)
    assert other.time_s == pytest.approx(rows * 24 / 32 / (HW.network_gbps * 1e9 * HW.comm_efficiency))
    t = estimate_time(DSV3, _ep_layout(32), HW, 6 * DSV3.active, 64 * 4096)
    exposed = {c.name: c.exposed_s for c in t["comm"] if c.name.startswith("EP")}
    assert exposed == {"EP all-to-all, same-node peers": 0.0, "EP all-to-all, other nodes": pytest.approx(other.time_s)}
    assert ep_peer_shares(_ep_layout(8, tp=4)) == pytest.approx((1 / 8, 6 / 8))
    one_node = {c.name: c for c in estimate_comm(DSV3, _ep_layout(8), HW, st)}
    assert "EP all-to-all, other nodes" not in one_node
    assert one_node["EP all-to-all, same-node peers"].bytes_per_step == pytest.approx(rows * 7 / 8)
    skewed = {c.name: c for c in estimate_comm(DSV3, _ep_layout(32, imbalance=1.25), HW, st)}
    assert skewed["EP all-to-all, other nodes"].bytes_per_step == pytest.approx(1.25 * other.bytes_per_step)


def test_routing_imbalance_slows_the_busiest_ep_rank_by_hand():
    """plan.moe_imbalance f: the busiest EP rank runs f x the mean routed rows through its experts
    (the extra 6 x (f - 1) x top_k x expert params FLOPs per token, at the grouped-GEMM rate) and holds
    f x their activations; without EP every rank runs its own tokens' copies, so f changes nothing."""
    from launcher.plan.estimate.memory import layer_activation_bytes
    from launcher.plan.estimate.perf import expert_gemm_efficiency, matmul_peak, microbatch_compute_s

    st = stage_params(DSV3, 1)[0]
    base, skewed = _ep_layout(32), _ep_layout(32, imbalance=1.5)
    extra = microbatch_compute_s(DSV3, st, skewed, HW) - microbatch_compute_s(DSV3, st, base, HW)
    routed_flops = 6 * 0.5 * 58 * 8 * DSV3.expert * 4096
    rate = matmul_peak(HW, "bf16") * HW.achievable_fraction * expert_gemm_efficiency(DSV3, base)
    assert extra == pytest.approx(routed_flops / rate)
    a, h, fe = 2, 7168, 2048
    grown = layer_activation_bytes(DSV3, skewed, True, "none") - layer_activation_bytes(DSV3, base, True, "none")
    assert grown == pytest.approx(4096 * 8 * (a * h + 4 * a * fe) * 0.5)
    no_ep = dataclasses.replace(base, mesh=MeshPlan(dp_shard=64))
    assert microbatch_compute_s(DSV3, st, no_ep, HW) == microbatch_compute_s(
        DSV3, st, dataclasses.replace(no_ep, moe_imbalance=1.5), HW)


def test_grouped_gemm_efficiency_per_expert_by_hand():
    """Routed experts run as one grouped GEMM whose per-expert problems are rows x moe_ffn_dim: each
    expert gets tokens x top_k x ep / n_experts rows (balanced). Qwen3 30B-A3B at 32K tokens on one
    GPU: 2,048 rows x 768 -> 0.8 x 0.6 of achievable_fraction. (ByteDance-Seed/VeOmni PR 460 measured
    242 TFLOP/s for that MoE forward with torch._grouped_mm; at h100_sxm's achievable_fraction 0.75,
    issue 38, the plan says 356: optimistic for experts this narrow, docs/planner.md "Mixture of
    experts".) Our own H100 layer (below) is held. The other matmuls of an MoE block: FLOP-weighted,
    each at its narrower side (MLA's latent projections score low)."""
    from launcher.plan.estimate import elementwise
    from launcher.plan.estimate.perf import (CAST_BACKWARD_BYTES, CAST_FORWARD_BYTES, expert_gemm_efficiency,
                                             expert_rows, knee, moe_block_gemm_knee)

    qwen = model_shape(compose_spec(["model=qwen3_30b_a3b"]).model)
    one = Layout(batch=RankBatchPlan(micro_batch_size=1, seq_len=32768))
    assert expert_rows(qwen, one) == 2048
    assert expert_gemm_efficiency(qwen, one) == pytest.approx(2048 / 2560 * 768 / 1280)
    # Our own H100 (docs/benchmarks.md, bench/gpu_moe.py): one launcher MoE layer at Mixtral 8x7B's
    # expert shapes, grouped, eager, forward + backward: 39.56 ms at 8,192 tokens, 132.75 ms at 32,768.
    # Planned by the terms that layer runs: the experts' GEMMs at the per-expert knee, the eager token
    # movement and SwiGLU (forward and the backward's BACKWARD_BYTES_FACTOR), and the grouped path's
    # casts of the fp32 expert weights (launcher/models/grouped_mm.py casts them itself).
    mixtral = model_shape(compose_spec(["model=mixtral_8x7b"]).model)
    bw = HW.hbm_gbps * 1e9 * elementwise.HBM_EFFICIENCY
    for tokens, measured_s in ((8192, 39.56e-3), (32768, 132.75e-3)):
        lay = Layout(batch=RankBatchPlan(micro_batch_size=1, seq_len=tokens))
        gemm_s = 6 * tokens * 2 * mixtral.expert / (HW.bf16_tflops * 1e12 * HW.achievable_fraction
                                                    * expert_gemm_efficiency(mixtral, lay))
        swiglu = 5 * lay.act_bytes * 2 * mixtral.moe_ffn_dim  # eager silu + multiply, top-2 copies
        moved = (elementwise.moe_dispatch_bytes(mixtral, lay) + swiglu) * (1 + elementwise.BACKWARD_BYTES_FACTOR)
        cast_s = mixtral.n_experts * mixtral.expert * (CAST_FORWARD_BYTES + CAST_BACKWARD_BYTES) / bw
        assert gemm_s + moved * tokens / bw + cast_s == pytest.approx(measured_s, rel=0.06)
    assert expert_rows(DSV3, _ep_layout(32)) == 4096  # 4,096 tokens x 8 / 256 experts x 32 ranks
    # DeepSeek-V3's MLA (wq_a 7168->1536, wq_b 1536->128x192, wkv_a 7168->576, wkv_b 512->128x256,
    # wo 128x128->7168) and its shared expert (3 x 7168 x 2048), 4,096 rows.
    mms = [(7168 * 1536, 1536), (1536 * 24576, 1536), (7168 * 576, 576), (512 * 32768, 512),
           (16384 * 7168, 7168)] + [(7168 * 2048, 2048)] * 3
    expected = sum(f * knee(4096, w) for f, w in mms) / sum(f for f, _ in mms)
    assert moe_block_gemm_knee(DSV3, 4096.0, 1) == pytest.approx(expected)
    assert 0.7 < expected < 0.8


def test_moe_imbalance_is_checked():
    from launcher.config.validate import validate

    ok = compose_spec(["model=debug_moe", "plan.moe_imbalance=1.3"])
    assert not [p for p in validate(ok) if "moe_imbalance" in p]
    bad = compose_spec(["model=debug_moe", "plan.moe_imbalance=0.8"])
    assert any("plan.moe_imbalance=0.8 must be at least 1" in p for p in validate(bad))


def test_moe_imbalance_flows_from_the_config_to_the_plan():
    """plan.moe_imbalance reaches the Layout (plan.json's layout) and the step: a skewed routing load
    slows an EP layout's plan and the assumptions line names it; a dense model ignores it."""
    from launcher.plan.present.plan import build_plan
    from launcher.plan.present.report import plan_json

    base = ["model=qwen3_30b_a3b", "action=plan", "cluster.nodes=2", "cluster.gpus_per_node=8", "parallel.ep=16",
            "trainer.seq_len=4096", "trainer.global_batch_size=16", "plan.plots=false"]
    even, skewed = (compose_spec(base + [f"plan.moe_imbalance={f}"]) for f in (1.0, 1.4))
    p_even, p_skewed = build_plan(even), build_plan(skewed)
    assert p_skewed.layout.moe_imbalance == 1.4 and plan_json(p_skewed, skewed)["layout"]["moe_imbalance"] == 1.4
    assert p_skewed.time["step_s"] > p_even.time["step_s"]
    assert "1.4x the mean routed tokens (plan.moe_imbalance)" in plan_json(p_skewed, skewed)["assumptions"]
    assert "balanced routing (plan.moe_imbalance=1" in plan_json(p_even, even)["assumptions"]
    dense = ["model=llama_1b", "action=plan", "cluster.gpus_per_node=8", "plan.plots=false"]
    assert build_plan(compose_spec(dense + ["plan.moe_imbalance=1.4"])).time["step_s"] == \
        build_plan(compose_spec(dense)).time["step_s"]


def test_tp_leaves_the_moe_whole_by_hand():
    """launcher/parallel/tp.py runs the whole MoE on the full sequence on every TP rank (all-gathered
    under SP): with TP 2 + SP each rank dispatches all 4,096 tokens' rows (EP 32 strided by tp: 4 ep
    ranks per node, 3/32 of the rows same-node, 28/32 over the network), and the routed experts'
    extra FLOPs and activations of a skewed load are those of TP 1, not halved."""
    from launcher.plan.estimate.memory import layer_activation_bytes
    from launcher.plan.estimate.perf import microbatch_compute_s

    st = stage_params(DSV3, 1)[0]
    tp2 = dataclasses.replace(_ep_layout(32, tp=2), sp=True)
    rows = 4096 * 8 * 7168 * 2 * 58 * 4
    comm = {c.name: c for c in estimate_comm(DSV3, tp2, HW, st)}
    assert comm["EP all-to-all, same-node peers"].bytes_per_step == pytest.approx(rows * 3 / 32)
    assert comm["EP all-to-all, other nodes"].bytes_per_step == pytest.approx(rows * 28 / 32)

    def skew(lay, what):
        return what(dataclasses.replace(lay, moe_imbalance=1.5)) - what(lay)

    tp1 = _ep_layout(32)
    assert skew(tp2, lambda lay: microbatch_compute_s(DSV3, st, lay, HW)) == pytest.approx(
        skew(tp1, lambda lay: microbatch_compute_s(DSV3, st, lay, HW)))
    assert skew(tp2, lambda lay: layer_activation_bytes(DSV3, lay, True, "none")) == pytest.approx(
        skew(tp1, lambda lay: layer_activation_bytes(DSV3, lay, True, "none")))
    from launcher.plan.estimate.elementwise import moe_dispatch_bytes

    # The token movement of the full sequence on each TP rank: 2a gather + 4a EP permutes + 3a
    # compiled combine per element of the top_k dim-wide rows (eager: 16 + 5a for the combine).
    assert moe_dispatch_bytes(DSV3, tp2) == moe_dispatch_bytes(DSV3, tp1) == (2 * 2 + 4 * 2 + 16 + 5 * 2) * 8 * 7168


def test_terms_that_centre_the_plan_on_our_gpu_runs():
    """Issue 38: what the one-GPU profiles showed the plan lacked, and the MoE block as the runtime
    compiles it. (1) On a rank without FSDP2 autocast casts every matmul weight each way (12 B per
    weight over HBM); FSDP2 gathers its units already in bf16: none. (2) Gradient clipping reads
    and scales every local fp32 gradient (12 B) in the optimizer step. (3) An MoE block under
    compile keeps its routing, token movement and routed SwiGLU eager and its norms unfused
    (launcher/parallel/compile.py). (4) A pipeline's idle slot lasts a micro-batch with the EP
    all-to-all exposed inside it."""
    from launcher.plan.estimate import elementwise
    from launcher.plan.estimate.memory import autocast_cast_elements
    from launcher.plan.estimate.perf import GRAD_CLIP_BYTES, bubble_slots, optimizer_step_s, weight_cast_s

    bw = HW.hbm_gbps * 1e9 * elementwise.HBM_EFFICIENCY
    st = stage_params(SHAPE, 1)[0]
    one = Layout(numerics=NumericsPlan(precision="bf16"))
    assert weight_cast_s(SHAPE, st, one, HW) == pytest.approx(autocast_cast_elements(st, SHAPE, one) * 12 / bw)
    assert weight_cast_s(SHAPE, st, Layout(mesh=MeshPlan(dp_shard=8), numerics=NumericsPlan(precision="bf16")),
                         HW) == 0.0
    adam_s = st.shared * 28.0 / (HW.hbm_gbps * 1e9 * 0.7)
    assert optimizer_step_s(st, one, HW) == pytest.approx(adam_s + st.shared * GRAD_CLIP_BYTES / bw)

    mixtral = model_shape(compose_spec(["model=mixtral_8x7b"]).model)  # every block MoE, no shared expert
    a, h, f = 2, mixtral.dim, mixtral.moe_ffn_dim * mixtral.top_k
    compiled = Layout(compile=True, numerics=NumericsPlan(precision="bf16"))
    eager = dataclasses.replace(compiled, compile=False)
    at = mixtral.attention_layout
    attention_part = 2 * a * (at.n_heads + at.rope_k_heads) * at.rope_dim + 2 * a * at.n_heads * at.v_head_dim
    assert elementwise.block_forward_bytes(mixtral, compiled) == pytest.approx(
        2 * 2 * a * h + 6 * a * h  # two norms compiled alone, two eager residual adds
        + attention_part + 5 * a * f  # RoPE and the SDPA copy compiled; the routed SwiGLU eager
        + elementwise.moe_dispatch_bytes(mixtral, eager))
    assert elementwise.block_forward_bytes(mixtral, compiled) < elementwise.block_forward_bytes(mixtral, eager)

    spec = compose_spec(["model=deepseek_v3", "action=plan", "cluster.gpus_per_node=8", "cluster.nodes=64", "precision=bf16", "trainer.seq_len=4096", "trainer.compile=true",
                         "activation_checkpointing=full", "parallel.pp=8", "parallel.pp_schedule=interleaved_1f1b",
                         "parallel.pp_virtual_stages=2", "parallel.ep=32", "parallel.zero_stage=2",
                         "trainer.micro_batch_size=1", "trainer.global_batch_size=1024"])
    from launcher.plan.present.plan import build_plan

    plan = build_plan(spec)
    t, lay = plan.time, plan.layout
    ep = sum(c["exposed_s"] for c in plan.comm["collectives"] if c["name"].startswith("EP"))
    assert ep > 0 and t["bubble_s"] == pytest.approx(
        (t["microbatch_s"] + ep / lay.batch.microbatches) * bubble_slots(lay))
