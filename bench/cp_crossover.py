"""The planner's all-gather vs ring context parallelism by sequence length (issue 42).

    .venv/bin/python bench/cp_crossover.py             # a markdown table (docs/parallelism.md)

Plans, in process as `train action=plan` does, Llama-3-8B on one node (FSDP over dp_shard x
cp=8, torchtitan's CP layout of Table 2: full AC, compile, bf16) and DeepSeek-V3 on 32 nodes
(cp=8, EP 64 over dp_shard x cp, FSDP, full AC; no pipeline: CP is not combined with PP) at each
sequence length, once with backend.cp_impl=ring and once with allgather, on H100s; prints the
planned tokens/s per GPU and memory of each, and which the planner prefers. One GPU cannot run
CP > 1, so these are the planner's figures, not measurements.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEQS = (8192, 32768, 131072, 262144)
MODELS = {
    "Llama-3-8B": ["model=llama3_8b", "cluster.nodes=1", "parallel.cp=8", "activation_checkpointing=full",
                   "trainer.compile=true", "precision=bf16"],
    "DeepSeek-V3": ["model=deepseek_v3", "cluster.nodes=32", "parallel.cp=8", "parallel.ep=64",
                    "activation_checkpointing=full", "precision=bf16"],
}


def plan(overrides):
    from launcher.config.loader import compose_spec
    from launcher.plan.estimate.memory import GiB
    from launcher.plan.present.plan import build_plan

    p = build_plan(compose_spec(["action=plan", "cluster.gpus_per_node=8", "plan.plots=false",
                                 "trainer.micro_batch_size=1", *overrides]))
    return p.time["tokens_per_s_per_gpu"], p.memory["total"] / GiB


def main() -> int:
    print("| model | seq_len | ring tok/s/GPU | all-gather tok/s/GPU | ring GiB | all-gather GiB | faster |")
    print("|---|---|---|---|---|---|---|")
    for name, base in MODELS.items():
        for s in SEQS:
            common = [*base, f"trainer.seq_len={s}", f"model.max_seq_len={s}", "trainer.global_batch_size=64"]
            r_tps, r_mem = plan([*common, "backend.cp_impl=ring"])
            a_tps, a_mem = plan([*common, "backend.cp_impl=allgather"])
            faster = "all-gather" if a_tps > r_tps else "ring"
            print(f"| {name} | {s // 1024}K | {r_tps:,.0f} | {a_tps:,.0f} | {r_mem:.1f} | {a_mem:.1f} | {faster} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
