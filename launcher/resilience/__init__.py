"""Resilience: a run that survives a failed rank, a lost or unfit node, a hang or a straggler.

- restarts.py: the in-job restart decision (`python -m launcher.resilience.restarts decide`, run
  by `train` for a local run and by the SLURM batch script) and resilience.jsonl. Torch-free;
- node_exclusion.py: which nodes a restart leaves out, and the spares that replace them (torch-free);
- failure.py: the failure bundle each rank leaves (summary.json, stacks) and the errors it
  classifies. The host reads it, so it imports torch only inside the functions the ranks call;
- watchdog.py: the hang watchdog and the flight recorder's environment;
- preflight.py: the pre-flight health probe of every rank (matmul, all-reduce bandwidth);
- health.py: what the training loop tells these tools (steps done, long phases, saves);
- stragglers.py: a rank slower than its peers, named and, if asked, excluded;
- debug_hooks.py: test aids that make one rank hang, raise, run out of memory or probe badly,
  so real multi-process tests produce the failures the rest of this package handles.

Imports from launcher/observe/ (the OOM memory snapshot) and launcher/job_env.py, never from the
rank's loop (launcher/runtime/) nor the launchers (launcher/launch/), which call in. The modules
the host reads (restarts, node_exclusion, failure, watchdog) import no torch at the top.
docs/slurm.md and docs/observability.md are the user guides.
"""
