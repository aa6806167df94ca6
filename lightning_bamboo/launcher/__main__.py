"""``python -m lightning_bamboo.launcher``: see the package's docstring and ``--help``."""

import sys

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.launcher import main

if __name__ == "__main__":
    try:
        sys.exit(main())
    except BambooConfigError as err:  # a wrong argument: the rule and the fix, without a traceback
        print(f"python -m lightning_bamboo.launcher: error: {err}", file=sys.stderr)
        sys.exit(2)
