"""`python -m verispec.cli`: the same as the `verispec` command."""

import sys

from . import main

sys.exit(main())
