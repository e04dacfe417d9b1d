"""`python -m tessel ...` is the same as `tessel ...` (what torchrun launches)."""

import sys

from tessel.cli import main

sys.exit(main())
