"""Estimating a layout: the numbers the planner gives for a Layout. Pure Python, no torch.

- params.py: parameter counts from a model shape (ModelShape, per stage);
- flops.py: training FLOPs per token and MFU, the one place these formulas live;
- memory.py: per-GPU memory by category (model states, activations, working buffers);
- perf.py: communication volume, pipeline bubble, step time, tokens/s; with ring.py (context
  parallelism's ring attention) and elementwise.py (the memory-bound work of a step);
- muon.py: Muon's Newton-Schulz FLOPs, the owner assignment the engine also uses, and one rank's
  Muon work (momentum elements, FLOPs, gather bytes) from the layout's `muon_matrices`;
- checkpoint_time.py: how long a save takes and how long a graceful stop may need;
- bands.py: error bands from the accuracy rows, by layout kind;
- budget.py: time and money to a token budget;
- figures.py: fills a Plan's estimates (plan.json's plain dicts) from all of the above.

Imports the Layout record and its degrees (launcher/plan/layout.py, degrees.py), the model
families' formulas (launcher/models/) and the config, never the deciding (launcher/plan/decide/)
nor the presenting (launcher/plan/present/): the resolver calls in here when a decision needs a
number (memory that must fit), so the import runs one way.
"""
