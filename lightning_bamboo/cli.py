"""The ``lightning-bamboo`` command: one sub-command per module, imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module providing ``add_arguments(parser)`` and ``run(args) -> int``, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "fit": ("lightning_bamboo.strategy.cli", "train with the Lightning CLI (--config X.yaml)"),
    "demo": ("lightning_bamboo.demo.cli", "a local spot cluster that trains through preemptions"),
    "plan": (
        "lightning_bamboo.planner.cli",
        "profile a model and print its plan (--json) or a plan table for world sizes 1..N",
    ),
    "prepare": ("lightning_bamboo.models.prepare", "tokenize local text files into train.bin/val.bin for TokenCorpus"),
    "simulate": (
        "lightning_bamboo.sim.cli",
        "replay a spot trace: throughput, cost and value of on-demand, checkpoint-restart and Bamboo",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="lightning-bamboo", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # prints help or the usage error and exits
        return 2
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(COMMANDS[name][0])
    command_parser = argparse.ArgumentParser(prog=f"lightning-bamboo {name}", description=COMMANDS[name][1])
    module.add_arguments(command_parser)
    from lightning_bamboo.errors import BambooError

    try:
        if getattr(module, "PASS_THROUGH", False):
            return int(module.run(rest) or 0)
        return int(module.run(command_parser.parse_args(rest)) or 0)
    except BambooError as err:
        print(f"lightning-bamboo {name}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
