"""Checkpoints: the folder on disk, the ranks' save and resume protocol, asynchronous saves, the node-local tier.

- folder.py: names, manifests, the folder lock, timelines. Torch-free: the host side (`train`,
  launcher/launch/) imports it to check that no other job holds the checkpoint folder;
- manager.py: CheckpointManager, the ranks' atomic save and resume (engine state, RNG, manifest);
- async_save.py: the background half of `checkpoint.async=true` (its own process group, DCP writers);
- local_tier.py: the node-local tier (`checkpoint.local_dir`) with its replica on the next node.

Imports from the engines (the state each engine saves), launcher/parallel/ (the phase group) and
launcher/job_env.py, never from the rank's loop (launcher/runtime/) nor the launchers: the
runtime and launch/ call in. The package itself imports nothing, so folder.py stays torch-free.
docs/checkpoints.md is the user guide.
"""
