"""The peer: plain DeepSpeed pipeline training of the demo's GPT, restarted by torchrun from DeepSpeed checkpoints.

What a user runs today on spot machines: one ``torchrun`` elastic agent per machine, this script as the
worker, ``engine.save_checkpoint`` every ``--save-every`` steps and ``engine.load_checkpoint`` at every
(re)start. ``benchmarks/peers.py`` runs it against ``lightning-bamboo demo`` on the same trace slice::

    torchrun --nnodes=1:6 --nproc-per-node=1 --max-restarts=100 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:PORT --rdzv-id=peer \\
        --rdzv-conf=is_host=false,last_call_timeout=2,keep_alive_interval=5,keep_alive_max_attempt=3 \\
        benchmarks/peer_train.py --steps 300 --save-dir ckpt --save-every K --events events.jsonl

with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in each agent's environment. ``is_host=false``: the
rendezvous store runs on a machine that is not preempted; a restart waits 2 s for late agents instead of
torch's 30; the heartbeat is torch's (a lost agent is dropped after 15 s). The variable: by default
torchrun's workers share a store hosted by the agent of rank 0 of the *first* round, whose address the
other agents keep (torch 2.13 reads it once); when a later round has another rank 0 (its old host was
preempted, a new machine joined), the workers of one job meet in different stores, or in a dead one, and
``init_process_group`` waits until its timeout, every restart again (seen on the g4dn slice: no step for
7 minutes). pytorch/pytorch#135712 names the flag as the way out: each round's rank 0 then starts a fresh store.

It trains what the demo trains (``lightning_bamboo/demo/worker.py``): the GPT of ``CONFIG`` (8 pipeline
layers), SGD (lr 0.05, momentum 0.9), one pipeline, 8 samples per step in 4 micro-batches of 2, layers
split by parameter count, the samples of step ``s`` being ``8 s .. 8 s + 7`` of the same synthetic
tokens, in order (a restart goes on from the step its checkpoint holds: no sample skipped or repeated).

**Depth.** DeepSpeed needs the world size divisible by the pipeline depth, and the world size is whatever
the rendezvous gathered. A user with one pipeline makes its depth the live world size: each (re)start
splits the 8 layers over the nodes it has (``num_stages = WORLD_SIZE``).

**Optimizer state when the depth changes.** DeepSpeed's pipeline checkpoint keeps the weights per layer
(``layer_NN-model_states.pt``: they load into any depth), but the optimizer state per stage
(``mp_rank_NN_model_states.pt``: that stage's ``optimizer.state_dict()``, indexed by the stage's own
parameters). DeepSpeed 0.19.8 loads it by rank, not by layer: a checkpoint of 3 stages loaded with its
optimizer state into 2 stops with ``ValueError: loaded state dict contains a parameter group that doesn't
match the size of optimizer's group`` (seen), and as torch's ``load_state_dict`` checks only the number of
parameters per group, a stage whose count happens to match would take other layers' momentum. So at a depth other than the checkpoint's this script loads the weights only
(``load_optimizer_states=False``): the SGD momentum restarts from zero, as a careful user's script would,
and the run is no longer the run without preemptions (the demo's checkpoints keep the optimizer state per
layer and stay exact). It logs ``"optimizer": "reset"`` when it does. At the checkpoint's depth it loads
everything. The lr has no schedule, so nothing else is lost.

Every process appends JSON lines to ``--events``: ``start`` (before the imports), ``ready`` (process
group and engine built), ``loading``/``loaded``, ``step`` (rank 0, after each step), ``saved``, ``error``
(the exception that ended it: how it noticed a lost peer) and ``done``. ``benchmarks/peers.py`` reads them.
"""

import time

STARTED = time.time()  # before the imports: a restart's process start is part of what it costs

import argparse  # noqa: E402
import datetime  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.pipe import PipelineModule  # noqa: E402

from lightning_bamboo.engine.construct import skip_shm_op  # noqa: E402
from lightning_bamboo.models.gpt import GPTConfig, gpt_layers, gpt_loss  # noqa: E402

#: the demo's model (lightning_bamboo.demo.worker.CONFIG; importing that module would import Lightning)
CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=6, n_head=2, n_embd=48)
GLOBAL_BATCH, MICRO_BATCH = 8, 2  # lightning_bamboo.demo.shape.GLOBAL_BATCH, the demo worker's micro-batch


class Events:
    """Appends one JSON line per event to a file every process shares (an appended line is never torn)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.fields = {"node": os.environ.get("PEER_NODE", "?"), "rank": int(os.environ.get("RANK", 0)),
                       "world": int(os.environ.get("WORLD_SIZE", 1)), "pid": os.getpid(),
                       "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))}

    def __call__(self, event: str, at: float | None = None, **fields) -> None:
        if not self.path:
            return
        line = json.dumps({"event": event, "t": time.time() if at is None else at, **self.fields, **fields})
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


def tokens(samples: int) -> torch.Tensor:
    """The demo's synthetic sequences (lightning_bamboo.demo.worker.Tokens): seed 0, ``block_size + 1`` each."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, CONFIG.vocab_size, (samples, CONFIG.block_size + 1), generator=g)


def micro_batches(data: torch.Tensor, step: int):
    """The micro-batches of every step from ``step`` on, in order: ``(inputs, targets)``, targets shifted by one."""
    for start in range(step * GLOBAL_BATCH, len(data), MICRO_BATCH):
        rows = data[start:start + MICRO_BATCH]
        yield rows[:, :-1], rows[:, 1:]


def checkpoint_depth(save_dir: Path) -> int | None:
    """The pipeline depth the latest checkpoint was written at (its count of per-stage files), None if none."""
    latest = save_dir / "latest"
    if not latest.exists():
        return None
    return len(list((save_dir / latest.read_text().strip()).glob("mp_rank_*_model_states.pt"))) or None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--save-every", type=int, default=25, help="steps between checkpoints (K)")
    parser.add_argument("--keep", type=int, default=2, help="checkpoints kept (older ones are removed)")
    parser.add_argument("--events", default=None, help="append JSON event lines here")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds every node pauses after each step")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a collective or the process group's start may block (default 120: a restart's "
                        "workers import torch and DeepSpeed at once on shared cores; 0: DeepSpeed's 10 minutes)")
    args = parser.parse_args()
    log = Events(args.events)
    log("start", at=STARTED)
    faulthandler.register(signal.SIGUSR1)  # peers.py asks a worker that overran where it is
    try:
        return train(args, log)
    except BaseException as err:  # how this worker learnt of a lost peer (or why it failed), then re-raised
        log("error", error=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300])
        raise


def train(args: argparse.Namespace, log: Events) -> int:
    save_dir = Path(args.save_dir)
    # On CPU, DeepSpeed's init_distributed JIT-builds a shared-memory all-reduce op under a lock file in
    # ~/.cache/torch_extensions: a worker killed while it builds leaves the lock, and every later start on the
    # machine waits for it forever (a new virtual environment's path makes it build again). A GPU machine's
    # DeepSpeed has no such op, and the training never uses it: the peer skips it as lightning_bamboo does.
    skip_shm_op()
    if args.timeout:
        deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=args.timeout))
    else:
        deepspeed.init_distributed(dist_backend="gloo")
    world = torch.distributed.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every node and at every depth
    model = PipelineModule(layers=gpt_layers(CONFIG), loss_fn=gpt_loss, num_stages=world,
                           partition_method="parameters")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": GLOBAL_BATCH // MICRO_BATCH,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    log("ready", stages=world)

    depth = checkpoint_depth(save_dir)
    if depth is not None:
        same = depth == world
        log("loading", depth=depth)
        began = time.time()
        path, _ = engine.load_checkpoint(str(save_dir), load_optimizer_states=same, load_lr_scheduler_states=same)
        log("loaded", seconds=time.time() - began, step=engine.global_steps, depth=depth,
            optimizer="loaded" if same else "reset", path=str(path))
    else:
        log("loaded", seconds=0.0, step=0, depth=None, optimizer="fresh", path=None)

    data = micro_batches(tokens(args.steps * GLOBAL_BATCH), engine.global_steps)
    loss = None
    while engine.global_steps < args.steps:
        loss = engine.train_batch(data_iter=data)
        if engine.global_rank == 0:
            log("step", step=engine.global_steps, loss=float(loss))
        if args.step_delay:
            time.sleep(args.step_delay)  # as the demo's --step-delay: a longer step, the same on every node
        if args.save_every and engine.global_steps % args.save_every == 0 and engine.global_steps < args.steps:
            began = time.time()
            engine.save_checkpoint(str(save_dir))
            log("saved", step=engine.global_steps, seconds=time.time() - began)
            if engine.global_rank == 0:
                prune(save_dir, args.keep)
    log("done", step=engine.global_steps, loss=None if loss is None else float(loss))
    return 0


def prune(save_dir: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` checkpoints (``global_stepN`` folders; ``latest`` names the newest)."""
    tags = sorted((p for p in save_dir.glob("global_step*") if p.is_dir()), key=lambda p: int(p.name[11:]))
    for old in tags[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
