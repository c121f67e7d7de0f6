"""`python -m engram.cli ...` (as the `engram` script; torchrun workers of `engram train --nproc` start this way)."""

import sys

from . import main

sys.exit(main())
