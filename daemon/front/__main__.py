"""``python -m vqpool.daemon.front serve ...``: the ``vqpool`` command."""

import sys

from vqpool.daemon.front.cli import main

sys.exit(main())
