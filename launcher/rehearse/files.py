"""Where a rehearsal keeps its files under the run dir, named once for the driver and the ranks.

Both launcher/rehearse/driver.py (on the host, no torch) and launcher/rehearse/rank.py (one
process per rank) read these names; the driver also starts the rank module, so the names live
here, below both, and neither imports the other for them.
"""

from __future__ import annotations

# The fake steps measured so far, by step signature (the ranks share them; emptied when a
# rehearsal starts).
SHARED_STEPS_DIR = "rehearsal/steps"
