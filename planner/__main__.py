"""``python -m planner``: the same as the ``planner`` command."""

import sys

from planner.cli import main

sys.exit(main())
