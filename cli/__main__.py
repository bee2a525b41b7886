"""`python -m spanguard.cli`: the `spanguard` command, where its script is not on PATH."""

import sys

from spanguard.cli.main import main

sys.exit(main())
