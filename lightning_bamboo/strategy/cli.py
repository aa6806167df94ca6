"""``lightning-bamboo fit``: the Lightning CLI with strategy='bamboo' registered."""

from __future__ import annotations

import argparse
import os
import sys

PASS_THROUGH = True  # arguments go to LightningCLI unparsed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("args", nargs=argparse.REMAINDER, help="LightningCLI arguments, e.g. --config X.yaml")


def run(argv: list[str]) -> int:
    # Configs name the user's own modules (class_path: examples.gpt.GPTModule): import them
    # from the working directory, as `python -m` would.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    # strategy="bamboo" is registered: importing this module ran lightning_bamboo/__init__.py first
    from lightning.pytorch.cli import LightningCLI

    # LightningCLI reads sys.argv when given no args (and warns when given both, as `lightning-bamboo fit ...`
    # would be): it sees the command line a plain LightningCLI script would, `PROG fit ARGS...`.
    saved = sys.argv
    # argv[0] stays the program: Lightning's launcher starts the other ranks by running sys.argv again
    sys.argv = [saved[0] or "lightning-bamboo", "fit", *argv]
    try:
        LightningCLI(
            subclass_mode_model=True,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
        )
    finally:
        sys.argv = saved
    return 0
