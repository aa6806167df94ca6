"""``python -m lightning_bamboo.sim``: the simulate command without the console script."""

from __future__ import annotations

import sys

from lightning_bamboo.sim.cli import main

sys.exit(main())
