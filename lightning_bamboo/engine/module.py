"""Building the layers of a pipeline, each process only its own, and a PipelineModule cut at given boundaries."""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy
import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from lightning_bamboo.engine.layer_rng import StepKeys, run_layers, run_layers_checkpointed
from lightning_bamboo.engine.precision import Precision
from lightning_bamboo.errors import BambooConfigError

log = logging.getLogger(__name__)


#: parameters of layers returned built (``nn.Module``s, which every process builds whole) above which the census
#: warns that ``LayerSpec``s would build only each process's own
BUILT_PARAMETERS_WARNING = 100_000_000

#: a ``TiedLayerSpec`` key -> the global indices of its layers, ascending (see :func:`build_layers`)
Ties = dict[str, tuple[int, ...]]


@dataclass
class BuiltLayers:
    """The layers a process built (``None`` where a layer lives elsewhere) and every layer's class name."""

    layers: list[Any]  # nn.Module, a plain callable, or None where the layer is not kept
    names: list[str]  # class name per layer (DeepSpeed's "type:REGEX" partitioning)
    ties: Ties = field(default_factory=dict)


@dataclass(frozen=True)
class LayerCensus:
    """What the partition needs of every layer without holding any: its trainable parameters and class name."""

    param_counts: list[int]  # trainable parameters per layer (DeepSpeed's "parameters" weights)
    names: list[str]
    ties: Ties = field(default_factory=dict)


def layer_init_seed(seed: int, index: int) -> int:
    """The seed the ``LayerSpec`` at global ``index`` is built under: DeepSpeed's ``seed_layers`` rule, ``seed + index``.

    It depends on the layer alone, never on which process builds it or in which layout, so a stage, a replica, a
    failover's or an admission's rebuild all build equal weights for it (and equal DeepSpeed's own
    ``PipelineModule(seed_layers=True, base_seed=seed)``: Python's, numpy's and torch's streams are seeded as its
    ``deepspeed.runtime.utils.set_random_seed`` seeds them).
    """
    return seed + index


def build_layers(
    factory: Callable[[], Sequence[Any]], seed: int, keep: Callable[[int], bool] = lambda i: True
) -> BuiltLayers:
    """Build the layers ``keep(index)`` selects, under the layer-wise initialisation contract.

    ``factory`` (``configure_pipeline``) is called with torch's stream seeded with ``seed`` (the CPU's; the GPUs'
    too once CUDA has started): layers it returns already built (``nn.Module``s, callables) are
    ``torch.manual_seed(seed); factory()``'s, as before, and every process pays for all of them. A ``LayerSpec`` is built only where it is kept, under its own seed
    (:func:`layer_init_seed`), so a process materialises only its layers and each layer gets the same values whatever
    else is built. A ``LayerSpec`` not kept is never built. The caller's random streams (torch's, numpy's, Python's)
    are left as they were.

    Tied layers (``TiedLayerSpec``s of one key, e.g. GPT-2's token embedding and its output head): each process
    builds its own copy of the tied module at every index it keeps, all under the seed of the key's first index, so
    every copy starts equal (DeepSpeed builds it on the first stage and broadcasts it). A copy's ``forward`` is
    the spec's ``forward_fn(module, x)`` where it has one. The engine sums the copies' gradients into every copy
    (``engine.ties``), so the copies stay equal; every parameter of the module is tied (as within one DeepSpeed
    stage), and the copies after the first are marked ``bamboo_tied_copy`` (a global norm counts them once).
    """
    with _own_streams():
        _seed_torch(seed)
        specs = _layer_list(factory)
        ties = tied_layers(specs)
        layers: list[Any] = []
        names: list[str] = []
        for index, spec in enumerate(specs):
            specs[index] = None  # let a layer that is not kept be freed
            if isinstance(spec, TiedLayerSpec):
                names.append(spec.typename.__name__)
                layers.append(_build_tied(spec, seed, ties[str(spec.key)], index) if keep(index) else None)
            elif isinstance(spec, LayerSpec):
                names.append(spec.typename.__name__)
                layers.append(_build_spec(spec, seed, index) if keep(index) else None)
            else:
                names.append(_name(index, spec))
                layers.append(spec if keep(index) else None)
    return BuiltLayers(layers, names, ties)


def tied_layers(specs: Sequence[Any]) -> Ties:
    """Every ``TiedLayerSpec`` key of ``specs`` with the indices of its layers."""
    ties: dict[str, list[int]] = {}
    for index, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            ties.setdefault(str(spec.key), []).append(index)
    return {key: tuple(indices) for key, indices in sorted(ties.items())}


def _build_tied(spec: TiedLayerSpec, seed: int, indices: tuple[int, ...], index: int) -> nn.Module:
    """The copy of a tied module at ``index``: built as the key's first layer is, running ``forward_fn`` if any."""
    module = _build_spec(spec, seed, indices[0])
    if spec.forward_fn is not None:
        # an instance attribute: the module keeps its own parameter names (``"<index>.<name>"``) and DeepSpeed,
        # the replica and the checkpoints treat it as any other layer
        module.forward = functools.partial(spec.forward_fn, module)
    if index != indices[0]:
        for param in module.parameters():
            param.bamboo_tied_copy = True  # type: ignore[attr-defined]
    return module


def is_tied_copy(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to a tied module's copy after the first (its gradient is the first copy's)."""
    return bool(getattr(param, "bamboo_tied_copy", False))


def census_layers(factory: Callable[[], Sequence[Any]], seed: int) -> LayerCensus:
    """Every layer's trainable parameters and class name, none kept.

    A ``LayerSpec`` is built on the meta device (shapes, no storage, no values: nothing of its weights is
    materialised; a constructor that cannot run there is built on the CPU and dropped). Layers the factory returns
    built are counted as they are.
    """
    counts: list[int] = []
    names: list[str] = []
    built = 0  # parameters of the layers the factory returned built
    with _own_streams():
        _seed_torch(seed)
        specs = _layer_list(factory)
        ties = tied_layers(specs)
        for index, spec in enumerate(specs):
            specs[index] = None
            if isinstance(spec, LayerSpec):  # a tied layer's copy counts at every index: each holder keeps one
                names.append(spec.typename.__name__)
                counts.append(_trainable(_shape_of(spec, seed, index)))
            else:
                names.append(_name(index, spec))
                counts.append(_trainable(spec) if isinstance(spec, nn.Module) else 0)
                built += counts[-1]
    if built > BUILT_PARAMETERS_WARNING:
        log.warning(
            "configure_pipeline() returned %s parameters as built nn.Module layers: every process builds and holds "
            "all of them (fp32: %.1f GiB each, at start and at every failover) besides its own stage and replica. "
            "Return DeepSpeed LayerSpecs (LayerSpec(Block, config)) to build only each process's layers.",
            f"{built:,}", built * 4 / 2**30)
    return LayerCensus(counts, names, ties)


def _layer_list(factory: Callable[[], Sequence[Any]]) -> list[Any]:
    specs = list(factory())
    if not specs:
        raise BambooConfigError("configure_pipeline() returned no layers; return a list of nn.Module layers or LayerSpecs")
    first: dict[str, int] = {}
    for index, spec in enumerate(specs):
        if not isinstance(spec, TiedLayerSpec):
            continue
        key = str(spec.key)
        other = specs[first.setdefault(key, index)]
        if other.typename is not spec.typename:
            raise BambooConfigError(
                f"TiedLayerSpec {key!r} builds a {spec.typename.__name__} at layer {index} but a "
                f"{other.typename.__name__} at layer {first[key]}: the layers of one key share one module (built as "
                f"the first one is), so give them the same class and arguments, and a forward_fn where one of them "
                f"uses the module differently"
            )
    return specs


def _name(index: int, layer: Any) -> str:
    if not isinstance(layer, nn.Module) and not callable(layer):
        raise BambooConfigError(
            f"configure_pipeline() must return nn.Module layers, LayerSpecs or callables; "
            f"layer {index} is a {type(layer).__name__}"
        )
    return type(layer).__name__ if isinstance(layer, nn.Module) else getattr(layer, "__name__", "fn")


def _trainable(layer: nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters() if p.requires_grad)


def _build_spec(spec: LayerSpec, seed: int, index: int) -> nn.Module:
    # DeepSpeed's set_random_seed (Python's, numpy's and torch's streams), except that a CUDA not initialised yet is
    # left alone: torch would queue the seed and apply it to the process's own GPU streams when CUDA starts
    layer_seed = layer_init_seed(seed, index)
    random.seed(layer_seed)
    numpy.random.seed(layer_seed % 2**32)
    _seed_torch(layer_seed % 2**63)
    return spec.build()


def _seed_torch(seed: int) -> None:
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


def _shape_of(spec: LayerSpec, seed: int, index: int) -> nn.Module:
    try:
        with torch.device("meta"):
            return _build_spec(spec, seed, index)
    except Exception as err:  # noqa: BLE001 - any constructor that needs real tensors
        log.debug("LayerSpec %d (%s) cannot be built on the meta device (%s): counted on the CPU", index,
                  spec.typename.__name__, err)
        return _build_spec(spec, seed, index)


@contextmanager
def _own_streams() -> Iterator[None]:
    """Torch's CPU stream (and the GPUs' once CUDA is up), numpy's and Python's, restored on exit."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    python_state, numpy_state = random.getstate(), numpy.random.get_state()
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python_state)
        numpy.random.set_state(numpy_state)


class Splice:
    """Forward results of layers ``boundary..`` (the end of a stage) computed earlier, to be reused once.

    ``kept[k]`` is ``(input, output)`` of those layers on micro-batch ``k``: the input a graph leaf,
    the output with its graph (an eager redundant forward, RF). The stage that now runs those
    layers (a node that took over its dead successor from the replica, sharing the replica's layer
    objects) skips their forward for micro-batch ``k`` and backpropagates through the kept graph (RB).
    """

    def __init__(self, boundary: int, kept: dict[int, tuple[Any, Any]]) -> None:
        self.boundary = boundary
        self.kept = kept
        self.reused: list[int] = []  # micro-batches whose forward was reused
        self.backwards = 0  # lazy backwards run through kept graphs
        self.anchor = torch.zeros((), requires_grad=True)  # makes the output need a gradient on the first stage


class _Reuse(torch.autograd.Function):
    """Output: the kept RF output. Backward: through the kept graph (RB), handing on its input gradient."""

    @staticmethod
    def forward(ctx: Any, inputs: torch.Tensor, anchor: torch.Tensor, kept: Any, splice: Splice) -> torch.Tensor:  # noqa: ARG004
        ctx.kept, ctx.splice = kept, splice
        return kept[1].detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        leaf, output = ctx.kept
        torch.autograd.backward(output, grad)
        ctx.splice.backwards += 1
        return leaf.grad if ctx.needs_input_grad[0] else None, None, None, None


def _same(recomputed: torch.Tensor, leaf: Any) -> bool:
    return torch.is_tensor(leaf) and recomputed.shape == leaf.shape and bool(torch.equal(recomputed.detach(), leaf.detach()))


class BambooPipelineModule(PipelineModule):
    """A ``PipelineModule`` cut at explicit layer boundaries (``parts``) instead of by a method.

    Layers that other stages own may be ``None``: only this stage's layers are touched. With a
    ``splice`` (see ``Splice``) the forward of its micro-batches reuses kept results. With ``keys``
    (``layer_rng.StepKeys``, set by the engine for each training step) every layer draws its random
    numbers from a stream of its own, the same on any stage that runs it.
    """

    splice: Splice | None = None
    keys: StepKeys | None = None
    #: bf16/fp16 compute (``engine.precision``): the layers and the loss run under its autocast on ``compute_device``
    precision: Precision | None = None
    compute_device = torch.device("cpu")
    #: layers per activation-checkpointed segment while training (0: none): a segment keeps only its input, and its
    #: forward runs again in its backward, drawing the same random numbers (each layer re-seeds its streams from the
    #: step's keys, ``layer_rng``), so the gradients are those of a run without it, bit for bit
    checkpoint_every = 0
    #: training forwards run in this step: the local index of the micro-batch the next one runs (1F1B runs a
    #: stage's forwards in micro-batch order); the engine sets it to 0 when a step begins
    forwards = 0
    #: the model's tied layers (``TiedLayerSpec`` key -> layer indices; :func:`build_layers`), whichever this stage
    #: holds: the engine sums their copies' gradients (``engine.ties``)
    ties: Ties = {}  # noqa: RUF012 - never mutated: replaced whole

    def __init__(self, layers: Sequence[Any], parts: Sequence[int], **kwargs: Any) -> None:
        self._bamboo_parts = list(parts)
        super().__init__(layers=layers, **kwargs)
        self._layer_specs: list[Any] = [None] * self._num_layers  # drop references to the other stages' layers

    def _partition_layers(self, method: str = "uniform") -> None:  # noqa: ARG002 - DeepSpeed's signature
        num_stages = self._topo.get_dim("pipe")
        stage_id = self._topo.get_coord(self.global_rank).pipe
        if len(self._bamboo_parts) != num_stages + 1:
            raise BambooConfigError(
                f"partition {self._bamboo_parts} has {len(self._bamboo_parts) - 1} stages but the topology has {num_stages}"
            )
        self.parts = list(self._bamboo_parts)
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

    def set_precision(self, precision: Precision | None, device: torch.device) -> None:
        """Run the layers and the loss in ``precision`` (reduced: under autocast on ``device``'s type)."""
        self.precision, self.compute_device = precision, device
        loss_fn: Any = getattr(self, "loss_fn", None)
        if precision is not None and precision.reduced and loss_fn is not None:
            self.loss_fn = _InAutocast(loss_fn, precision, device)

    def forward(self, forward_input: Any) -> Any:
        precision = self.precision
        if precision is None or not precision.reduced:
            return _stage_forward(self, forward_input)
        with precision.autocast(self.compute_device):
            return _stage_forward(self, forward_input)


def _stage_forward(module: BambooPipelineModule, forward_input: Any) -> Any:
    """The stage's forward (its own or, with neither keys nor splice, DeepSpeed's)."""
    splice = module.splice
    keys = module.keys if module.training else None
    if (splice is None and keys is None and not module.checkpoint_every) or module.activation_checkpoint_interval \
            or module.seed_layers:
        return PipelineModule.forward(module, forward_input)
    micro_batch = module.forwards
    module.forwards += 1
    calls = list(enumerate(module.forward_funcs, start=module._local_start))
    if splice is None:
        every = module.checkpoint_every if module.training else 0
        return run_layers_checkpointed(calls, forward_input, keys, micro_batch, every)
    cut = splice.boundary - module._local_start
    x = run_layers(calls[:cut], forward_input, keys, micro_batch)
    kept = splice.kept.get(micro_batch)
    # Reused only where the stage recomputed exactly the input the kept forward ran on (the same
    # micro-batch through the same, uncommitted weights): anything else is computed afresh.
    if kept is None or not torch.is_tensor(x) or not torch.is_tensor(kept[1]) or not _same(x, kept[0]):
        return run_layers(calls[cut:], x, keys, micro_batch)
    splice.reused.append(micro_batch)
    return _Reuse.apply(x, splice.anchor, kept, splice)


class _InAutocast:
    """A loss function run under the stage's autocast (a loss in fp32 from bf16/fp16 outputs, as autocast computes it)."""

    def __init__(self, fn: Any, precision: Precision, device: torch.device) -> None:
        self.fn, self.precision, self.device = fn, precision, device

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision.autocast(self.device):
            return self.fn(*args, **kwargs)
