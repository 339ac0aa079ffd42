"""The launcher package (see README.md and ../shared/DESIGN.md)."""

import time as _time

# When this process started (the package is the first thing `train` and every rank import): the
# goodput accounting's launch and process start times (launcher/observe/goodput.py).
PROCESS_STARTED = _time.time()
