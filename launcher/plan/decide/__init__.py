"""Deciding a layout: resolve(spec) -> Layout, every derived decision made once. Pure Python, no torch.

- resolve.py: the resolver; validates the config, derives the degrees, the accumulation and
  the backend of every feature, and builds the Layout (launcher/plan/layout.py);
- support.py: the support table, per feature and backend: when that backend refuses it, why,
  and the Fix;
- rules.py: the decision over the table: the backend per feature and the conflicts as data;
- backends.py: the rules as a report, and `python -m launcher.plan.decide.backends --markdown`
  (docs/backends.md's generated table).

Imports the record (launcher/plan/layout.py, degrees.py, features.py), the estimates
(launcher/plan/estimate/: a decision such as parallel.accumulate_unsharded=auto needs the memory
it would take), the config and the data checks; never the presenting (launcher/plan/present/).
"""
