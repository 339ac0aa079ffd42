"""The rank's loop: one training process from its start by torchrun to its exit.

- entry.py: `python -m launcher.runtime.entry --run-dir DIR` (what torchrun and the job scripts
  start): the composition root that builds the engine, the data, the tools and the loop;
- trainer.py: the training loop (data -> engine step -> metrics -> checkpoints -> stop requests);
- dist.py: the process group's set-up and tear-down;
- metrics.py: metrics.jsonl, Weights & Biases and the console on rank 0;
- signals.py and stop_control.py: graceful stops (stop_control.py is the torch-free half the host
  reads too);
- heldout_loss.py, matmul_precision.py, export_action.py: validation, TF32, `action=export`.

Above checkpoint/, resilience/ and observe/, which it calls: it may import every room below
launch/ except the rehearsal, which sits beside it and runs this entry for each rank (the import
runs one way, rehearse -> runtime). Nothing below imports it.
"""
