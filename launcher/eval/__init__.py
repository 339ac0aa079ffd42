"""Downstream evaluation: lm-eval's tasks scored on the live, sharded model in the training loop.

- `rows.py`: token rows -> summed log-likelihood of their scored tokens, through the engine's
  forward-only `eval_stats` (every layout the engines serve), collectively on every rank;
- `lm.py`: lm-eval's model interface (a `TemplateLM`) over those rows;
- `tasks.py`: the run's tasks, built once, offline; which lm-eval output types are served;
- `loop.py`: one evaluation at a step -> `eval/<task>/<metric>` metrics.

lm-eval (the optional extra `launcher[eval]`) is imported only here and in the launch pre-check.
"""
