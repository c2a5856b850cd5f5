"""Allow ``python -m tasktool``."""

import sys

from tasktool.cli import main

sys.exit(main())
