"""Pieces the benchmarks share: how they start a job under the launcher, how a script re-runs itself in a role, and the
GPT LightningModule they train with its synthetic data.

Importing this module costs nothing: torch, Lightning and ``lightning_bamboo`` are imported when a function here
needs them, and ``BenchGPT`` is made when first asked for. A benchmark's parent process that only starts jobs stays
small, and a child it starts does not inherit a large peak in ``ru_maxrss`` (``materialise.py`` measures that).

Every benchmark builds its launcher's command with :func:`launcher_command` and the environment its job runs in with
:func:`launcher_env`; :func:`run_under_launcher` runs a local job with both and returns its output. A script that runs
its own workers (or children) re-runs itself with :func:`self_command` under the one hidden option that
:func:`add_worker_flag` adds, ``--role ROLE``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from lightning_bamboo.models.gpt import GPTConfig

REPO = str(Path(__file__).resolve().parents[1])

#: the option a script reads to know it runs as one of its own workers (or children), and in which role
WORKER_FLAG = "--role"

#: variables that tie a process to this host's interface and address; a supervisor on a machine of its own (a
#: network namespace) finds its own, so its environment goes without them
HOST_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT")


def add_worker_flag(parser: argparse.ArgumentParser, choices: Sequence[str] | None = None) -> None:
    """Add the hidden ``--role ROLE`` to ``parser`` (default None: the script runs as the user started it);
    ``choices``: the roles the script knows, where it checks them."""
    parser.add_argument(WORKER_FLAG, default=None, choices=choices, help=argparse.SUPPRESS)


def self_command(script: str | os.PathLike[str], role: str, *args: object,
                 interpreter: Sequence[str] | None = None) -> list[str]:
    """The command that runs ``script`` again in ``role``: ``python SCRIPT --role ROLE ARGS...``, each of ``args`` as
    ``str`` gives it. ``interpreter``: what runs the script in place of this interpreter (e.g. ``python -m
    torch.distributed.run --nproc_per_node 2``)."""
    return [*(interpreter or [sys.executable]), str(Path(script).resolve()), WORKER_FLAG, role, *map(str, args)]


def launcher_command(worker: Sequence[str], *, nodes: int | None = None, node: str | None = None,
                     store: str | None = None, job: str | None = None, workers: int | None = None,
                     min_nodes: int | None = None, join: bool = False, peers: Sequence[str] = (),
                     addr: str | None = None, pid_dir: str | os.PathLike[str] | None = None,
                     options: Sequence[str] = ()) -> list[str]:
    """``python -m lightning_bamboo.launcher ... -- WORKER...`` in one of its two forms.

    ``nodes``: the local form, ``--nodes N``: N nodes on this machine. ``node``: one supervisor of a machine,
    ``--node NAME``, with ``--store URL``, ``--job JOB``, ``--workers K``, ``--join`` or ``--min-nodes M``,
    ``--peers A,B,...``, ``--addr ADDR`` and ``--pid-dir DIR`` where given. ``options``: any other of the launcher's
    options (e.g. etcd's credentials), placed before ``--``."""
    if (nodes is None) == (node is None):
        raise ValueError("launcher_command takes nodes (the local form) or node (a machine's supervisor), one of them")
    command = [sys.executable, "-m", "lightning_bamboo.launcher"]
    if nodes is not None:
        command += ["--nodes", str(nodes)]
    else:
        command += ["--store", store] if store is not None else []
        command += ["--job", job] if job is not None else []
        command += ["--node", str(node)]
        command += ["--workers", str(workers)] if workers is not None else []
        command += ["--join"] if join else []
        command += ["--min-nodes", str(min_nodes)] if min_nodes is not None else []
        command += ["--peers", ",".join(peers)] if peers else []
        command += ["--addr", addr] if addr is not None else []
        command += ["--pid-dir", os.fspath(pid_dir)] if pid_dir is not None else []
    return [*command, *options, "--", *worker]


def launcher_env(tree: str | os.PathLike[str] | None = None, kills: Sequence[str] = (),
                 once_dir: str | os.PathLike[str] | None = None, extra: Mapping[str, str] | None = None,
                 unset: Iterable[str] = ()) -> dict[str, str]:
    """The environment a benchmark's job runs in: this process's, with DeepSpeed on the CPU (``DS_ACCELERATOR=cpu``)
    and ``tree`` (default: this repository) first on ``PYTHONPATH``, so that the launcher and its workers import its
    ``lightning_bamboo``; then ``extra`` added, and ``LOCAL_RANK`` and ``unset`` removed (a job started from inside
    another one must not take that one's rank for its own).

    The faults armed are the call's only: ``kills`` (``BAMBOO_FAIL_AT`` items of ``lightning_bamboo.testing.faults``,
    each firing once where ``once_dir`` names a folder); without them none, whatever this process's environment arms."""
    from lightning_bamboo.testing import faults

    path = os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.fspath(tree or REPO), path])), **(extra or {})}
    for name in ("LOCAL_RANK", *faults.ENV_NAMES, *unset):
        env.pop(name, None)
    if kills:
        env.update(faults.environment(list(kills), once_dir))
    return env


def run_under_launcher(nodes: int, worker: list[str], kills: Sequence[str] = (), timeout: float = 3000,
                       tree: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m lightning_bamboo.launcher --nodes N -- WORKER...`` as a user runs it, from ``tree``, its output
    captured (warnings off); ``kills``: ``BAMBOO_FAIL_AT`` items (``lightning_bamboo.testing.faults``); ``tree``: the
    source tree whose ``lightning_bamboo`` the launcher and its workers import (default: this repository's); ``env``:
    added to theirs."""
    repo = tree or REPO
    full = launcher_env(repo, kills, extra={"PYTHONWARNINGS": "ignore", **(env or {})})
    return subprocess.run(launcher_command(worker, nodes=nodes), cwd=repo, env=full, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


def token_dataset(config: GPTConfig, samples: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    """Random token sequences (fixed seed); the target is the input shifted by one."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (samples, config.block_size + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _bench_gpt() -> type:
    import lightning.pytorch as pl
    import torch

    from lightning_bamboo.models.gpt import gpt_layers, gpt_loss

    class BenchGPT(pl.LightningModule):
        """The GPT of ``config`` as pipeline layers, AdamW, ``samples`` synthetic samples in batches of
        ``batch_size``."""

        def __init__(self, config: GPTConfig, samples: int, batch_size: int) -> None:
            super().__init__()
            self.config, self.samples, self.batch_size = config, samples, batch_size

        def configure_pipeline(self):
            return gpt_layers(self.config)

        def pipeline_loss(self, outputs, targets):
            return gpt_loss(outputs, targets)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(token_dataset(self.config, self.samples), batch_size=self.batch_size)

    BenchGPT.__qualname__ = "BenchGPT"  # found as common.BenchGPT, as if defined at the top (pickle, reprs)
    return BenchGPT


def __getattr__(name: str) -> Any:
    """``BenchGPT``, made on first use: it subclasses Lightning's module, whose import costs seconds and memory."""
    if name == "BenchGPT":
        cls = globals()["BenchGPT"] = _bench_gpt()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
