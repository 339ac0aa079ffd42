"""Presenting a layout: the Plan document, its report and plots, and the search over layouts. Pure Python.

- plan.py: the Plan (plan.json): the Layout plus its estimates and warnings, built once by
  `build_plan(spec)` and read back by the ranks, the rehearsal and the executors;
- report.py: a Plan (`action=plan`) or search results (`action=search`) as text tables or JSON;
- plots.py: PNG charts of a plan (memory per GPU, the pipeline schedule); matplotlib, imported
  only when charts are drawn;
- search.py: `action=search`: enumerate layouts, keep those valid that fit, rank them.

The top of launcher/plan/: imports the deciding (launcher/plan/decide/), the estimating
(launcher/plan/estimate/), the record at plan/'s root, the config and the data checks; nothing in
launcher/plan/ imports it. Everything above the plan (cli, launch, runtime, rehearse) reads the Plan
from here.
"""
