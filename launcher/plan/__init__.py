"""The planner: what the launcher decides before any GPU is touched. Pure Python: no torch, no DeepSpeed.

One record at the root, read by every part and by the engines: layout.py (the Layout, every
derived decision), degrees.py (the parallel degrees and the rank order) and features.py (the
feature x backend table). Three concepts, one subpackage each, importing one way:

    present/   the Plan document, its report and plots, the search        (imports decide, estimate)
    decide/    resolve(spec) -> Layout, its rules and support table        (imports estimate)
    estimate/  parameters, FLOPs, memory, time, bands, budget of a Layout  (imports the record only)

Below the parallel techniques and the engines, beside data/ (whose checks it runs), above config/:
it may import the config, the data checks and the model families' formulas (launcher/models/), never torch
(tests/test_layers.py runs `action=plan` and `action=search` and checks it).
"""
