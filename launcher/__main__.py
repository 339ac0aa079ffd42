"""`python -m launcher ...` is the `train` command (for interpreters where the console script is
not installed, e.g. a GPU image running from a source checkout)."""

import sys

from launcher.cli import main

if __name__ == "__main__":
    sys.argv[0] = "train"
    main()
