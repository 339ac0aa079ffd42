"""Measurement of a run: what it holds and spends, set against the plan.

- memtrack.py: measured peak memory per category during a step (torch's MemTracker), and the
  predicted-vs-measured rows;
- state_bytes.py: the bytes of model states a rank holds between steps (parameters, gradients,
  optimizer states). It stays apart from memtrack.py: it sums the optimizers' tensors once
  (their local shards), where memtrack follows every allocation through a step; the two share
  only the unwrapping of the optimizers (state_bytes.torch_optimizers);
- memory_snapshot.py: CUDA allocator snapshots on an OOM or on request;
- profiler.py: torch.profiler traces of the chosen ranks;
- moe_health.py and moe_load.py: tokens per expert, idle experts, the `moe/*` load metrics;
- run_score.py: measured tokens/s, MFU and peak memory against the plan's prediction;
- rehearsal_table.py: the rehearsal's rehearsed-vs-planned bytes per rank, as a W&B table.

Imports from launcher/plan/ (the predictions it compares with) and launcher/models/, never from
the rank's loop (launcher/runtime/), which calls in, nor from the engines. The rehearsal
(launcher/rehearse/rank.py) measures with the same memtrack and state_bytes as a real run.
"""
