"""The layout-equivalence matrix: which layouts run in which torchrun launch.

One launch per world size (start-up costs 4-5 s each); launches run in the order
4 -> 2 -> 1 ranks so that a checkpoint saved by a bigger world can be resumed by a smaller
one. ``REFERENCE[name]`` names the 1-rank layout each layout must reproduce.
"""

from __future__ import annotations

from typing import Dict, List

MODELS = ("debug", "debug_moe")
SCHEDULES = {  # pp_schedule -> pp_virtual_stages
    "gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2, "zbv": 2,
}


# Qwen3-MoE's block on the debug sizes (debug_moe + these model keys): head_dim 24 (not dim /
# n_heads = 16), q/k RMSNorm, renormalised top-k, no shared expert, block 1 dense by mlp_only_layers.
QWEN3_MOE = {"family": "qwen3", "head_dim": 24, "qk_norm": True, "norm_topk_prob": True,
             "n_shared_experts": 0, "n_dense_layers": 0, "mlp_only_layers": [1]}
# DeepSeek-V3's block on the debug sizes (debug_moe + these model keys): MLA (query low-rank 16,
# key/value latent 32, 16+8 query/key and 16 value channels per head), YaRN RoPE, a sigmoid router
# over 2 groups of 2 experts (topk_group 1: both picks from one group), the correction bias moved
# every step with the global expert loads (aux-loss-free), the sequence-wise balance loss, debug_moe's
# shared expert, block 0 dense (first_k_dense_replace). Strong enough to be seen (1-rank, measured):
# bias_update_speed 0.01 against 0 moves step 2's loss by 2e-4 relative, aux_loss_alpha 0.01 against
# 0 step 1's grad norm by 2e-4 and step 3's loss by 7e-5 (the tolerances are 1e-4 and 1e-5).
DEEPSEEK_V3 = {"family": "deepseek_v3", "n_kv_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 32,
               "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
               "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
               "score_func": "sigmoid", "routed_scaling_factor": 2.5, "n_group": 2, "topk_group": 1,
               "norm_topk_prob": True, "bias_update_speed": 0.01, "aux_loss_alpha": 0.01, "aux_loss_coef": 0.0}


# The same with DeepSeek-V3's one multi-token-prediction depth (model.mtp_layers, launcher/models/mtp.py).
DSV3_MTP = {**DEEPSEEK_V3, "mtp_layers": 1}


# Sizes that do not divide by 2: FSDP's uneven shards and layout-independent init.
ODD = {"vocab_size": 251, "ffn_dim": 191, "moe_ffn_dim": 45, "n_experts": 3}


def _short(model: str) -> str:
    return "moe" if model == "debug_moe" else "dense"



def _family_moe_layouts(tag: str, overrides: dict) -> list:
    """A MoE family's two 4-rank layouts: EP x TP(+SP) x FSDP, and PP x EP x FSDP (1F1B)."""
    return [
        {"name": f"ep2_fsdp2_tp2_{tag}", "model": "debug_moe", "model_overrides": overrides,
         "mesh": {"dp_shard": 2, "tp": 2, "ep": 2}, "sp": True},
        {"name": f"pp2_ep2_fsdp2_{tag}", "model": "debug_moe", "model_overrides": overrides,
         "mesh": {"pp": 2, "dp_shard": 2, "ep": 2}, "pp_schedule": "1f1b"},
    ]

def layouts(ckpt_dir: str, device: str = "cpu") -> Dict[int, List[dict]]:
    """{world size: [layout, ...]} for the whole matrix (``device="cuda"`` adds cp=2)."""
    four, two, one = [], [], []
    if device == "cuda":
        for model in MODELS:
            m = _short(model)
            two.append({"name": f"cp2_{m}", "model": model, "mesh": {"cp": 2}})
            four.append({"name": f"cp2_fsdp2_{m}", "model": model, "mesh": {"dp_shard": 2, "cp": 2}})
        # Ring attention with Qwen3's QK-norm and head_dim != dim / n_heads, and with MLA (query/key
        # heads of 24 channels, values of 16, YaRN's softmax scale, the decoupled RoPE key rotated by
        # the sharded table's global positions). Not yet run on GPUs (written on a CPU-only machine).
        two += [{"name": "cp2_qwen3moe", "model": "debug_moe", "model_overrides": QWEN3_MOE, "mesh": {"cp": 2}},
                {"name": "cp2_dsv3", "model": "debug_moe", "model_overrides": DEEPSEEK_V3, "mesh": {"cp": 2}}]
    for model in MODELS:
        m = _short(model)
        one.append({"name": f"ref_{m}", "model": model, "export": f"{ckpt_dir}/export_ref_{m}.pt"})
    one.append({"name": "ref_tied", "model": "debug", "tie": True})
    two.append({"name": "fsdp2_tied", "model": "debug", "tie": True, "mesh": {"dp_shard": 2}})
    odd = ODD
    one.append({"name": "ref_odd", "model": "debug_moe", "model_overrides": odd})
    # 2 experts over ep=2 inside dp_shard=4: one expert per ep rank, FSDP-sharded over 2 ranks on
    # dim 1 (dim 0 has 1 row), the router [2, dim] too (launcher/parallel/fsdp.py).
    one.append({"name": "ref_2experts", "model": "debug_moe", "model_overrides": {"n_experts": 2}})
    four.append({"name": "ep2_fsdp4_2experts", "model": "debug_moe", "model_overrides": {"n_experts": 2},
                 "mesh": {"dp_shard": 4, "ep": 2}})
    two.append({"name": "fsdp2_odd", "model": "debug_moe", "model_overrides": odd, "mesh": {"dp_shard": 2}})
    for model in MODELS:
        m = _short(model)
        four += [
            {"name": f"fsdp2_tp2_{m}", "model": model, "mesh": {"dp_shard": 2, "tp": 2}, "sp": True},
            {"name": f"pp2_tp2_{m}", "model": model, "mesh": {"pp": 2, "tp": 2}, "pp_schedule": "1f1b",
             "export": f"{ckpt_dir}/export_pp2_tp2_{m}.pt"},
            {"name": f"hsdp2x2_{m}", "model": model, "mesh": {"dp_replicate": 2, "dp_shard": 2}},
        ]
        two += [
            {"name": f"fsdp2_{m}", "model": model, "mesh": {"dp_shard": 2}},
            {"name": f"tp2_{m}", "model": model, "mesh": {"tp": 2}},
            {"name": f"tp2_sp_{m}", "model": model, "mesh": {"tp": 2}, "sp": True},
        ]
        for sched, v in SCHEDULES.items():
            two.append({"name": f"pp2_{sched}_{m}", "model": model, "mesh": {"pp": 2},
                        "pp_schedule": sched, "pp_virtual_stages": v})
    four += [
        {"name": "tp4_gqa_refused", "model": "debug", "mesh": {"tp": 4},
         "expect_error": "model.n_kv_heads=2 is not divisible by 4"},
        {"name": "ep2_fsdp2_tp2_moe", "model": "debug_moe",
         "mesh": {"dp_shard": 2, "tp": 2, "ep": 2}, "sp": True},
        # ep=2 inside dp_shard=4: each expert shard is FSDP-sharded over the other 2 ranks.
        {"name": "ep2_fsdp4_moe", "model": "debug_moe", "mesh": {"dp_shard": 4, "ep": 2}},
        {"name": "ep2_hsdp2x2_moe", "model": "debug_moe",
         "mesh": {"dp_replicate": 2, "dp_shard": 2, "ep": 2}},
        {"name": "pp2_ep2_moe", "model": "debug_moe", "mesh": {"pp": 2, "dp_shard": 2, "ep": 2},
         "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2, "ac": "full"},
    ]
    # Experts folded over TP (issue 42): ep=4 spans both TP ranks of both FSDP ranks, each TP rank
    # routing its own half of the sequence; the ranks record the rows their expert computed
    # (count_expert_rows), and the checkpoint it saves resumes under another folding (ep=2 over
    # the TP pair, no FSDP) and on 1 rank.
    four.append({"name": "ep4_tp2_fsdp2_moe", "model": "debug_moe", "mesh": {"dp_shard": 2, "tp": 2, "ep": 4},
                 "count_expert_rows": True, "save_dir": f"{ckpt_dir}/ep4_tp2_moe", "save_after": 2})
    two.append({"name": "resume_ep4tp2_as_tp2_ep2_moe", "model": "debug_moe", "mesh": {"tp": 2, "ep": 2},
                "load_dir": f"{ckpt_dir}/ep4_tp2_moe", "start_step": 2})
    one.append({"name": "resume_ep4tp2_as_1rank_moe", "model": "debug_moe",
                "load_dir": f"{ckpt_dir}/ep4_tp2_moe", "start_step": 2})
    one.append({"name": "ref_qwen3moe", "model": "debug_moe", "model_overrides": QWEN3_MOE})
    four += _family_moe_layouts("qwen3moe", QWEN3_MOE)
    # The same two 4-rank layouts as Qwen3-MoE: EP x TP(+SP) x FSDP shards MLA's heads under TP next
    # to experts folded over TP (ep=2 is the TP pair: each TP rank routes its own half of the
    # sequence, the sequence-wise balance loss summed over the pair); PP x EP x FSDP puts the dense block and the MoE blocks on different stages, each
    # stage moving its own blocks' bias. Measured (2 cores, load 8-14): about 1.5 s and 3.5 s in the
    # 4-rank launch, 0.3 s for ref_dsv3, about 6 s for both in the rehearsal fixture.
    one.append({"name": "ref_dsv3", "model": "debug_moe", "model_overrides": DEEPSEEK_V3})
    four += _family_moe_layouts("dsv3", DEEPSEEK_V3)
    # DeepSeek-V3 with its multi-token-prediction depth: under PP x EP x FSDP it lives on the last
    # stage with a copy of stage 0's embedding, their gradients summed; under CP x TP(+SP) its block
    # is sharded like a main block, its shifted tokens and targets cut from whole rows before the
    # head-tail split (the shift crosses the CP slices), experts folded over the cp x tp token group;
    # losses, grad norms and mtp/loss equal the 1-rank run's (tests/test_parallel_layouts.py). Each
    # saves after step 2 and the other layout resumes it: a pp=2 checkpoint (with the embedding copy,
    # mtp_embeddings) on 1 rank, a pp=1 one at pp=2 (the copy read from the embedding's entries).
    # Measured (2 cores, load ~30): ref_dsv3mtp 6 s (1.1 s of it building), pp2_ep2_fsdp2_dsv3mtp 5 s
    # (2.2 s) inside their launches; (load 15-26) cp2_tp2_sp_dsv3mtp 14 s for 3 steps (the comparable
    # cp2_tp2_qwen3moe_noaux 7 s), the two resumes under 1 s each.
    # Both export to HF after step 2 (fp32; the 1-rank run goes on to step 3): the MTP depth's
    # layer-N tensors gathered from TP shards, under their HF names, equal the 1-rank run's.
    one.append({"name": "ref_dsv3mtp", "model": "debug_moe", "model_overrides": DSV3_MTP,
                "export": f"{ckpt_dir}/export_ref_dsv3mtp", "export_after": 2, "export_format": "hf"})
    four.append({"name": "pp2_ep2_fsdp2_dsv3mtp", "model": "debug_moe", "model_overrides": DSV3_MTP,
                 "mesh": {"pp": 2, "dp_shard": 2, "ep": 2}, "pp_schedule": "1f1b",
                 "save_dir": f"{ckpt_dir}/pp2_dsv3mtp", "save_after": 2})
    four.append({"name": "cp2_tp2_sp_dsv3mtp", "model": "debug_moe", "model_overrides": DSV3_MTP,
                 "mesh": {"cp": 2, "tp": 2}, "sp": True, "save_dir": f"{ckpt_dir}/cp2_tp2_dsv3mtp", "save_after": 2,
                 "steps": 2,  # its third step is the pp=2 resume's
                 "export": f"{ckpt_dir}/export_cp2_tp2_dsv3mtp", "export_format": "hf"})
    two.append({"name": "resume_cp2tp2_as_pp2_dsv3mtp", "model": "debug_moe", "model_overrides": DSV3_MTP,
                "mesh": {"pp": 2}, "pp_schedule": "1f1b", "load_dir": f"{ckpt_dir}/cp2_tp2_dsv3mtp", "start_step": 2})
    # zbv's V holds the first and the last stage on pipeline rank 0: the embedding and its copy on
    # one rank, their gradients added there.
    two.append({"name": "pp2_zbv_dsv3mtp", "model": "debug_moe", "model_overrides": DSV3_MTP, "mesh": {"pp": 2},
                "pp_schedule": "zbv", "pp_virtual_stages": 2})
    one.append({"name": "resume_pp2_as_1rank_dsv3mtp", "model": "debug_moe", "model_overrides": DSV3_MTP,
                "load_dir": f"{ckpt_dir}/pp2_dsv3mtp", "start_step": 2})
    two += [
        {"name": "ep2_moe", "model": "debug_moe", "mesh": {"dp_shard": 2, "ep": 2}},
        # bf16 mixed precision: compared with the fp32 reference at a bf16 tolerance (bf16 keeps
        # 8 mantissa bits: 4e-3 per rounding). Deterministic run to run like fp32; measured against
        # the fp32 reference: loss 8.9e-5 relative, grad norm 2.9e-2 (fsdp2), 1.4e-2 (tp2).
        {"name": "bf16_tp2_dense", "model": "debug", "mesh": {"tp": 2},
         "precision": "bf16", "rtol": 2e-2, "gn_rtol": 0.1},
        {"name": "bf16_fsdp2_dense", "model": "debug", "mesh": {"dp_shard": 2},
         "precision": "bf16", "rtol": 2e-2, "gn_rtol": 0.1},
        # fp8 (torchao, emulated on CPU) under TP+SP: fp8 numerics (3 mantissa bits), so a loose
        # tolerance; deterministic run to run, measured: loss 8.0e-4 relative, grad norm 0.185.
        {"name": "fp8_tp2_sp_dense", "model": "debug", "mesh": {"tp": 2}, "sp": True,
         "precision": "fp8", "rtol": 1e-2, "gn_rtol": 0.3},
        {"name": "zero2_dense", "model": "debug", "mesh": {"dp_shard": 2}, "zero_stage": 2},
        # 2 micro-batches per rank and step: gradients accumulated unsharded (one reduce-scatter
        # per step) and sharded (one per micro-batch) must both match the 1-rank reference.
        {"name": "accum_unsharded_fsdp2_dense", "model": "debug", "mesh": {"dp_shard": 2},
         "accumulate_unsharded": "true", "expect_layout": {"microbatches": 2, "accumulate_unsharded": True}},
        {"name": "accum_unsharded_zero2_moe", "model": "debug_moe", "mesh": {"dp_shard": 2}, "zero_stage": 2,
         "accumulate_unsharded": "true", "expect_layout": {"microbatches": 2, "accumulate_unsharded": True}},
        {"name": "accum_sharded_fsdp2_dense", "model": "debug", "mesh": {"dp_shard": 2},
         "accumulate_unsharded": "false", "expect_layout": {"microbatches": 2, "accumulate_unsharded": False}},
        {"name": "ac_full_fsdp2_dense", "model": "debug", "mesh": {"dp_shard": 2}, "ac": "full"},
        {"name": "ac_op_fsdp2_moe", "model": "debug_moe", "mesh": {"dp_shard": 2}, "ac": "selective"},
        {"name": "ac_every2_tp2_dense", "model": "debug", "mesh": {"tp": 2}, "ac": "selective",
         "ac_selective": "2"},
        {"name": "zero1_refused", "model": "debug", "mesh": {"dp_shard": 2}, "zero_stage": 1,
         "backend_sharding": "native", "expect_error": "backend.sharding=deepspeed"},
        # One micro-batch of 4 sequences per step: the pipeline runs the accumulation micro-batches.
        {"name": "pp2_1microbatch_dense", "model": "debug", "mesh": {"pp": 2}, "micro_batch_size": 4,
         "pp_schedule": "gpipe"},
        {"name": "pp2_1f1b_1microbatch_refused", "model": "debug", "mesh": {"pp": 2},
         "micro_batch_size": 4, "expect_error": "needs at least 2 micro-batches per step"},
        {"name": "pp2_uneven_layers_dense", "model": "debug", "mesh": {"pp": 2}, "pp_layers": [1, 3]},
        {"name": "compile_fsdp2_dense", "model": "debug", "mesh": {"dp_shard": 2}, "compile": True},
        # FSDP2 CPUOffloadPolicy: parameters, gradients and optimizer states on the host.
        {"name": "offload_cpu_fsdp2_dense", "model": "debug", "mesh": {"dp_shard": 2}, "offload": "cpu"},
    ]
    if device == "cpu":
        # Ring context parallelism: refused on CPU; torch's sequence sharding is checked.
        two += [
            {"name": "cp_shard_check", "kind": "cp_shard", "seq": 16},
            {"name": "cp2_refused_on_cpu", "model": "debug", "mesh": {"cp": 2}, "cp_impl": "ring",
             "expect_error": "no CPU kernel"},
        ]
    # All-gather context parallelism (backend.cp_impl=auto picks it on CPU and for packed
    # documents): Llama with document masking and reset positions (its own reference; the
    # per-document load balancer splits each packed document over the cp ranks), alone, with
    # TP+SP and with FSDP; Qwen3-MoE (QK-norm, wide head_dim) and DeepSeek-V3 (MLA's gathered
    # latent, MoE with EP over dp_shard*cp) with their balance losses on: the Switch-style and
    # sequence-wise losses sum their statistics over the CP ranks holding slices of one sequence
    # (MoE.token_group), so they equal the 1-rank run's. A cp=2 checkpoint resumes on 1 rank.
    one += [{"name": "ref_docs", "model": "debug", "documents": True}]
    two += [
        {"name": "cp2_ag_docs", "model": "debug", "mesh": {"cp": 2}, "documents": True,
         "save_dir": f"{ckpt_dir}/cp2_docs", "save_after": 2},
        {"name": "cp2_ag_qwen3moe", "model": "debug_moe", "model_overrides": QWEN3_MOE, "mesh": {"cp": 2},
         "cp_impl": "allgather"},
        {"name": "cp2_ag_dsv3", "model": "debug_moe", "model_overrides": DEEPSEEK_V3, "mesh": {"cp": 2},
         "cp_impl": "allgather"},
    ]
    four += [
        {"name": "cp2_tp2_sp_docs", "model": "debug", "mesh": {"cp": 2, "tp": 2}, "sp": True, "documents": True},
        {"name": "cp2_fsdp2_docs", "model": "debug", "mesh": {"cp": 2, "dp_shard": 2}, "documents": True},
        {"name": "cp2_tp2_qwen3moe", "model": "debug_moe", "model_overrides": QWEN3_MOE,
         "mesh": {"cp": 2, "tp": 2}, "cp_impl": "allgather"},
        {"name": "cp2_ep2_fsdp2_dsv3", "model": "debug_moe", "model_overrides": DEEPSEEK_V3,
         "mesh": {"cp": 2, "dp_shard": 2, "ep": 2}, "cp_impl": "allgather"},
        # CP under pipelining: each rank slices the step's rows before the schedule, which cuts the
        # per-row key index into micro-batches with the rows; packed documents (the per-document
        # split, a different one per row) under 1F1B, and head-tail rows of the MoE model over
        # interleaved 1F1B's two chunks per rank (experts over dp_shard*cp = the cp pair).
        {"name": "pp2_cp2_docs", "model": "debug", "mesh": {"pp": 2, "cp": 2}, "documents": True,
         "pp_schedule": "1f1b"},
        {"name": "pp2_cp2_ep2_moe", "model": "debug_moe", "mesh": {"pp": 2, "cp": 2, "ep": 2},
         "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2},
    ]
    one.append({"name": "resume_cp2_as_1rank_docs", "model": "debug", "documents": True,
                "load_dir": f"{ckpt_dir}/cp2_docs", "start_step": 2})
    # Checkpoints across layouts: save after step 2 of 3, resume step 3 elsewhere.
    four.append({"name": "save_fsdp2_tp2_dense", "model": "debug", "mesh": {"dp_shard": 2, "tp": 2},
                 "save_dir": f"{ckpt_dir}/w4_dense", "save_after": 2})
    two += [
        {"name": "save_tp2_dense", "model": "debug", "mesh": {"tp": 2},
         "save_dir": f"{ckpt_dir}/tp2_dense", "save_after": 2},
        {"name": "resume_tp2_as_fsdp2_dense", "model": "debug", "mesh": {"dp_shard": 2},
         "load_dir": f"{ckpt_dir}/tp2_dense", "start_step": 2},
        {"name": "resume_w4_as_pp2_dense", "model": "debug", "mesh": {"pp": 2},
         "load_dir": f"{ckpt_dir}/w4_dense", "start_step": 2},
        {"name": "save_ep2_moe", "model": "debug_moe", "mesh": {"dp_shard": 2, "ep": 2},
         "save_dir": f"{ckpt_dir}/ep2_moe", "save_after": 2},
        {"name": "resume_ep2_as_tp2_moe", "model": "debug_moe", "mesh": {"tp": 2},
         "load_dir": f"{ckpt_dir}/ep2_moe", "start_step": 2},
    ]
    one += [
        {"name": "resume_tp2_as_1rank_dense", "model": "debug",
         "load_dir": f"{ckpt_dir}/tp2_dense", "start_step": 2},
        {"name": "resume_ep2_as_1rank_moe", "model": "debug_moe",
         "load_dir": f"{ckpt_dir}/ep2_moe", "start_step": 2},
    ]
    four_m, two_m, one_m = muon_layouts(ckpt_dir)
    return {4: four + four_m, 2: two + two_m, 1: one + one_m}


# optim=muon (issue 41): each 4-rank layout against its 1-rank run with the same optimizer.
# Newton-Schulz runs in bf16 (as torch.optim.Muon): a gradient that differs from the 1-rank one by
# its summation order (1e-7) can flip a bf16 rounding of the update, so these compare at 1e-4 on the
# loss and 1e-3 on the grad norm; measured (CPU, gloo) at most 4.9e-6 on the loss and 2.7e-4 on the
# grad norm (ep2_fsdp4_moe_muon).
MUON_TOL = {"optim": "muon", "rtol": 1e-4, "gn_rtol": 1e-3}


def muon_layouts(ckpt_dir: str):
    """([4-rank], [2-rank], [1-rank]) layouts of optim=muon: FSDP2 x TP(+SP), PP x FSDP, EP inside
    FSDP on the MoE and DeepSeek-V3 models, HSDP; a checkpoint saved on 4 ranks resumed on 2."""
    four = [
        {"name": "fsdp2_tp2_dense_muon", "model": "debug", "mesh": {"dp_shard": 2, "tp": 2}, "sp": True,
         "save_dir": f"{ckpt_dir}/w4_dense_muon", "save_after": 2, "state_digest": True, **MUON_TOL},
        {"name": "pp2_fsdp2_dense_muon", "model": "debug", "mesh": {"pp": 2, "dp_shard": 2},
         "pp_schedule": "1f1b", **MUON_TOL},
        {"name": "ep2_fsdp4_moe_muon", "model": "debug_moe", "mesh": {"dp_shard": 4, "ep": 2}, **MUON_TOL},
        {"name": "ep2_fsdp4_dsv3_muon", "model": "debug_moe", "model_overrides": DEEPSEEK_V3,
         "mesh": {"dp_shard": 4, "ep": 2}, **MUON_TOL},
        {"name": "hsdp2x2_dense_muon", "model": "debug", "mesh": {"dp_replicate": 2, "dp_shard": 2}, **MUON_TOL},
    ]
    # Save on 4 ranks (FSDP2 x TP), resume on 2 (FSDP2): the 2-rank run loads bitwise the state the
    # 4-rank run saved (state_digest: every parameter, momentum buffer and AdamW moment), matches the
    # 1-rank run within MUON_TOL, and saves again after its step; the 2-rank run resumed from that
    # save continues bitwise as a 2-rank run that trains on from the 4-rank checkpoint uninterrupted
    # (continue_*: compared with the resumed pair, not with the 1-rank run: 4 steps to its 3).
    w4, w2 = f"{ckpt_dir}/w4_dense_muon", f"{ckpt_dir}/w2_dense_muon"
    two = [{"name": "resume_w4_as_fsdp2_dense_muon", "model": "debug", "mesh": {"dp_shard": 2},
            "load_dir": w4, "start_step": 2, "state_digest": True, "save_dir": w2, "save_after": 3, **MUON_TOL},
           {"name": "resume_w2_as_fsdp2_dense_muon", "model": "debug", "mesh": {"dp_shard": 2},
            "load_dir": w2, "start_step": 3, "steps": 4, "no_reference": True, **MUON_TOL},
           {"name": "continue_w4_on_fsdp2_dense_muon", "model": "debug", "mesh": {"dp_shard": 2},
            "load_dir": w4, "start_step": 2, "steps": 4, "no_reference": True, **MUON_TOL},
           # Uneven shards: FSDP2's of the dense matrices (ffn_dim 191) and of an expert stack split on
           # its expert dimension (3 experts over 2 ranks: 2 and 1).
           {"name": "fsdp2_odd_muon", "model": "debug_moe", "model_overrides": ODD, "mesh": {"dp_shard": 2}, **MUON_TOL}]
    one = [{"name": f"ref_{tag}_muon", "model": model, "optim": "muon", **({"model_overrides": o} if o else {})}
           for tag, model, o in (("dense", "debug", None), ("moe", "debug_moe", None), ("dsv3", "debug_moe", DEEPSEEK_V3),
                                 ("odd", "debug_moe", ODD))]
    return four, two, one


def reference_of(name: str) -> str:
    if name.endswith("_muon"):  # optim=muon layouts compare with the 1-rank Muon run
        return reference_of(name[:-len("_muon")]) + "_muon"
    for suffix in ("_tied", "_odd", "_2experts", "_qwen3moe", "_dsv3", "_dsv3mtp", "_docs"):
        if name.endswith(suffix):
            return "ref" + suffix
    return "ref_moe" if name.endswith("_moe") else "ref_dense"
