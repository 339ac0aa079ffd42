"""The rehearsal: the real rank code at the real world size on a fake process group (fake
tensors on a CPU, or real ones on the local GPU).

- driver.py: `action=rehearse` / `trainer.rehearse=true` on the host: picks the ranks, runs one
  process per rank (forked from a server that imported torch once), compares each with the plan, renders the table and rehearsal.json;
- ranks.py: which ranks to rehearse and what the plan predicts for each (pure Python);
- rank.py: one rank (`python -m launcher.rehearse.rank`): builds its engine under fake tensors,
  measures the states it holds and a tracked fake step;
- step.py: the rank's training step as the rehearsal runs it (fake or real tensors; parts timed
  for real ones), and its tracked memory;
- real.py: `rehearse.tensors=real`: one rank with real tensors on the local device (CPU or GPU)
  against the fake process group, its parts timed and its peaks measured; local_device.py: what
  the host checks before (the GPU is visible, is the plan's `hardware`, and the rank fits it);
  real_report.py: the figures beside the plan's, and rehearsal_summary.json;
- fake_memory.py: corrections that make a fake step hold what a real one holds;
- pp_states.py: the smallest pipeline micro-batch count with the same peak;
- files.py: where a rehearsal keeps its files under the run dir (driver and ranks both read it).

The bytes are measured by the same code a real run uses (launcher/observe/state_bytes.py and
launcher/observe/memtrack.py). docs/rehearsal.md, is the user guide.
"""
