"""``python -m vqpool.daemon.ctl``: the same as the ``vqpoolctl`` console script."""

import sys

from vqpool.daemon.ctl.cli import main

if __name__ == "__main__":
    sys.exit(main())
