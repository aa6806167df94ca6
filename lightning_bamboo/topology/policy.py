"""Reconfiguration policy as a pure function: cluster state and current placement in, new placement out.

A *placement* is ``pipelines x stages`` nodes placed on a ``Layout`` (the layer split) plus the
micro-batches of each pipeline. Every node runs its own stage and keeps a replica of its successor's stage (the last
stage's replica lives on the first node of the pipeline). When a node is lost, its predecessor
(the *replica holder*) runs both stages and is *overloaded*; a lost stage whose replica holder
is lost or already overloaded cannot be served any more (a fatal, adjacent loss).

:func:`reconfigure` applies, in order (Bamboo's rules plus a depth change Bamboo lacks):

Every layout it builds has the shape ``shape_for`` gives the usable nodes.

1. ``start``/``recover``: no placement yet, or a stage lost both copies -> build a fresh placement.
2. ``suspend``: fewer usable nodes than the shallowest pipeline the model fits in -> no placement.
3. ``change_depth``: the current depth is below the preferred one and enough nodes are back; or one pipeline
   below it gets standby nodes (it grows by them, as deep as they make it); or, with nothing lost, another depth
   trains more of the usable nodes than the current layout does (``shape_for``: the preferred depth unless it leaves
   nodes idle and shallower pipelines, not below ``min_stages``, train more of them in a shorter step; four nodes
   at a preferred depth of 3 make 2 x 2, not 1 x 3 and an idle node).
4. ``rebalance``: standby nodes can relieve every overloaded node -> they take the lost places.
5. ``add_pipeline``: usable nodes are enough for more pipelines of the current depth.
6. ``restore_redundancy``: overloaded nodes are too large a share of the active ones
   (``2 * overloaded / active > max_overloaded_fraction``) -> rebuild with the nodes left,
   shallower if too few remain for one pipeline of the current depth.
7. ``keep``.

By default the global batch stays fixed: ``global_micro_batches`` are split over the pipelines as
evenly as possible (pipelines may differ by one micro-batch). With ``pipeline_micro_batches`` set,
every pipeline runs that many instead and the global batch follows the number of pipelines. Every placement it builds
keeps each pair of nodes whose joint loss is fatal on two failure domains (machines) where the nodes at hand allow it
(``apart.place_apart``; else the fewest such pairs, and ``Decision.warning`` says so), and then as many nodes as
possible on the stage they already hold, so that the least state moves. Under ``redundancy="auto"``
(``PolicyConfig.redundancy``) a stage keeps a replica only where every data-parallel copy of it shares one machine
(``replicas.kept_in_rows``); only the pairs of those replicas count, and pipelines whose copies of every stage span
two machines are left as they are (``replicas.place_for``). No torch here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.topology.apart import apart_warning
from lightning_bamboo.topology.layout import (
    REDUNDANCY_MODES,
    Layout,
    balanced_parts,
    even_parts,
    machine_of,
    split_micro_batches,
)
from lightning_bamboo.topology.replicas import kept_in_rows, place_for

ACTIONS = (
    "keep",
    "start",
    "recover",
    "suspend",
    "change_depth",
    "rebalance",
    "add_pipeline",
    "restore_redundancy",
)


class PolicyError(BambooConfigError):
    """The inputs of the reconfiguration policy contradict each other."""


def _check_names(what: str, names: Sequence[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if not isinstance(name, str) or not name:
            raise PolicyError(f"{what} must be non-empty node names (got {name!r}); pass names as str")
        if name in seen:
            raise PolicyError(f"{what} must not repeat a node (node {name!r} appears twice); list it once")
        seen.add(name)


@dataclass(frozen=True)
class PolicyConfig:
    """What the policy must respect: preferred depth, model size, global batch, risk tolerance."""

    stages: int  # preferred pipeline depth
    layers: int  # layers of the model (split over the stages)
    global_micro_batches: int  # micro-batches per optimizer step over all pipelines (fixed)
    min_stages: int = 1  # shallowest pipeline the model (and its replicas) fits in
    max_overloaded_fraction: float = 0.05  # rebuild when 2*overloaded/active exceeds this
    layer_costs: tuple[float, ...] | None = None  # relative compute time per layer (None: equal)
    pipeline_micro_batches: int | None = None  # None: global batch fixed; n: n per pipeline
    #: the job's redundancy: which replicas a placement keeps (``replicas.kept_in_rows``), hence which pairs of nodes
    #: it keeps on two machines; "lazy" (every replica) as the rules above assume
    redundancy: str = "lazy"

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise PolicyError(f"stages must be >= 1 (got {self.stages}); use at least one stage")
        if not 1 <= self.min_stages <= self.stages:
            raise PolicyError(
                f"min_stages must be between 1 and stages (min_stages: {self.min_stages}, "
                f"stages: {self.stages}); lower min_stages or raise stages"
            )
        if self.layers < self.stages:
            raise PolicyError(
                f"the model needs at least one layer per stage (layers: {self.layers}, "
                f"stages: {self.stages}); use fewer stages"
            )
        if self.global_micro_batches < 1:
            raise PolicyError(
                f"global_micro_batches must be >= 1 (got {self.global_micro_batches}); use a positive batch"
            )
        if not 0.0 <= self.max_overloaded_fraction <= 1.0:
            raise PolicyError(
                f"max_overloaded_fraction must be in [0, 1] (got {self.max_overloaded_fraction}); "
                "use e.g. 0.05 (Bamboo's 5%)"
            )
        if self.pipeline_micro_batches is not None and self.pipeline_micro_batches < 1:
            raise PolicyError(
                f"pipeline_micro_batches must be >= 1 or None (got {self.pipeline_micro_batches}); "
                "use None to keep the global batch fixed"
            )
        if self.redundancy not in REDUNDANCY_MODES:
            raise PolicyError(f"redundancy must be one of {REDUNDANCY_MODES} (got {self.redundancy!r})")
        if self.layer_costs is not None:
            if len(self.layer_costs) != self.layers or any(c <= 0 for c in self.layer_costs):
                raise PolicyError(
                    f"layer_costs must hold one positive number per layer (layers: {self.layers}, "
                    f"got {len(self.layer_costs)} values, min {min(self.layer_costs, default=0)}); "
                    "pass one positive cost per layer or None"
                )

    @property
    def max_pipelines(self) -> int | None:
        """The most pipelines a global batch can feed (None: no limit)."""
        return self.global_micro_batches if self.pipeline_micro_batches is None else None

    def micro_batches(self, pipelines: int) -> tuple[int, ...]:
        """Micro-batches of each of ``pipelines`` pipelines."""
        if self.pipeline_micro_batches is not None:
            return (self.pipeline_micro_batches,) * pipelines
        return split_micro_batches(self.global_micro_batches, pipelines)

    def parts(self, stages: int) -> tuple[int, ...]:
        """Layer boundaries for a pipeline of ``stages`` stages."""
        if self.layer_costs is None:
            return even_parts(self.layers, stages)
        return balanced_parts(self.layer_costs, stages)


@dataclass(frozen=True)
class Placement:
    """Nodes placed on a layout: ``grid[p][s]`` is the node running stage ``s`` (layers ``parts[s]:parts[s+1]``)
    of pipeline ``p``, which trains ``micro_batches[p]`` micro-batches per step."""

    grid: tuple[tuple[str, ...], ...]
    parts: tuple[int, ...]
    micro_batches: tuple[int, ...]  # per pipeline

    def __post_init__(self) -> None:
        if not self.grid or not self.grid[0]:
            raise PolicyError("a placement needs at least one pipeline of one stage (got an empty grid)")
        stages = len(self.grid[0])
        for p, row in enumerate(self.grid):
            if len(row) != stages:
                raise PolicyError(
                    f"every pipeline must have the same number of stages (pipeline 0: {stages}, "
                    f"pipeline {p}: {len(row)}); give each pipeline {stages} nodes"
                )
        _check_names("placement nodes", self.nodes)
        if (
            len(self.parts) != stages + 1
            or self.parts[0] != 0
            or any(b <= a for a, b in zip(self.parts, self.parts[1:], strict=False))
        ):
            raise PolicyError(
                f"parts must be {stages + 1} strictly increasing layer boundaries starting at 0 "
                f"(got {list(self.parts)}); use e.g. even_parts(layers, {stages})"
            )
        if len(self.micro_batches) != len(self.grid) or min(self.micro_batches) < 1:
            raise PolicyError(
                f"micro_batches needs one count >= 1 per pipeline (pipelines: {len(self.grid)}, "
                f"got {list(self.micro_batches)}); use split_micro_batches(total, {len(self.grid)})"
            )

    @property
    def pipelines(self) -> int:
        return len(self.grid)

    @property
    def stages(self) -> int:
        return len(self.grid[0])

    @property
    def layers(self) -> int:
        return self.parts[-1]

    @property
    def nodes(self) -> tuple[str, ...]:
        """The nodes pipeline by pipeline (``grid`` read row by row)."""
        return tuple(n for row in self.grid for n in row)

    @property
    def order(self) -> tuple[str, ...]:
        """The nodes by global rank: rank ``r`` is the node of stage ``r // pipelines`` of pipeline
        ``r % pipelines`` (``grid`` read column by column), as ``layout`` numbers them."""
        return tuple(row[s] for s in range(self.stages) for row in self.grid)

    @property
    def layout(self) -> Layout:
        """The rank-based layout this placement runs (node ``order[r]`` is rank ``r``)."""
        return Layout(self.stages, self.pipelines, self.parts)

    def position(self, node: str) -> tuple[int, int]:
        """(pipeline, stage) of ``node``."""
        for p, row in enumerate(self.grid):
            if node in row:
                return p, row.index(node)
        raise PolicyError(
            f"node {node!r} is not in the layout (nodes: {list(self.nodes)}); pass a layout node"
        )

    def replica_holder(self, node: str) -> str:
        """The node keeping a replica of ``node``'s stage: its predecessor, cyclically."""
        p, s = self.position(node)
        return self.grid[p][(s - 1) % self.stages]

    def successor(self, node: str) -> str:
        """The node whose stage ``node`` keeps a replica of."""
        p, s = self.position(node)
        return self.grid[p][(s + 1) % self.stages]

    def stage_layers(self, node: str) -> tuple[int, int]:
        """Layer range ``[start, end)`` that ``node`` runs."""
        s = self.position(node)[1]
        return self.parts[s], self.parts[s + 1]


@dataclass(frozen=True)
class Decision:
    """What the policy decided: an action, the layout to run (None: suspend) and why."""

    action: str
    layout: Placement | None
    reason: str
    moved: tuple[str, ...] = field(default=())  # nodes that must receive layers they do not hold
    #: for a log's WARNING: the layout puts two nodes whose joint loss is fatal on one machine, and why (None: it
    #: does not). The policy builds such a layout only where the machines at hand leave no other.
    warning: str | None = None

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise PolicyError(f"unknown action {self.action!r}; use one of {ACTIONS}")
        if (self.layout is None) != (self.action == "suspend"):
            raise PolicyError(
                f"action {self.action!r} and layout {self.layout!r} disagree: only 'suspend' has none"
            )

    @property
    def changed(self) -> bool:
        return self.action != "keep"

    def require_layout(self) -> Placement:
        """The layout, or a clear error when the decision is to suspend (too few nodes)."""
        if self.layout is None:
            raise PolicyError(
                f"cannot train: {self.reason}; add nodes, or lower min_stages if the model fits in fewer stages"
            )
        return self.layout


def machine_in(domains: Mapping[str, str] | None) -> Callable[[str], str]:
    """The failure domain of a node: ``domains[node]`` where given (a node missing from it is a domain of its own),
    else its machine by name (``machine_of``)."""
    if domains is None:
        return machine_of
    return lambda node: domains.get(node, node)


def fresh_placement(
    nodes: Sequence[str],
    pipelines: int,
    stages: int,
    config: PolicyConfig,
    domains: Mapping[str, str] | None = None,
) -> Placement:
    """The first ``pipelines * stages`` of ``nodes``, column by column: node ``i`` runs stage
    ``i // pipelines`` of pipeline ``i % pipelines``, unless that puts two nodes whose joint loss is fatal on one
    failure domain (``domains``, else the machine in the node's name): then the layout that keeps every such pair
    apart, with the rest of ``nodes`` too where that helps, or the one with the fewest such pairs
    (``apart.place_apart``).

    Nodes next to each other in ``nodes`` (typically started together, hence often preempted
    together) land in different pipelines, not on adjacent stages: losing up to ``pipelines`` of
    them at once is never an adjacent (fatal) loss.
    """
    need = pipelines * stages
    if pipelines < 1 or len(nodes) < need:
        raise PolicyError(
            f"{pipelines} pipelines of {stages} stages need {need} nodes (got {len(nodes)}); "
            "use fewer pipelines or stages, or add nodes"
        )
    rows = [[nodes[s * pipelines + p] for s in range(stages)] for p in range(pipelines)]
    grid = place_for(rows, config.redundancy, nodes[need:], machine_in(domains))
    return Placement(grid, config.parts(stages), config.micro_batches(pipelines))


def _pipelines(nodes: int, depth: int, config: PolicyConfig) -> int:
    """Pipelines of ``depth`` stages that ``nodes`` nodes make (no more than the global batch feeds)."""
    pipelines = nodes // depth
    return pipelines if config.max_pipelines is None else min(pipelines, config.max_pipelines)


def step_units(pipelines: int, depth: int, config: PolicyConfig) -> float:
    """The time of a step of ``pipelines x depth`` per micro-batch it trains, in units of one micro-batch through the
    whole model on one node: a 1F1B pipeline of ``depth`` stages running ``m`` micro-batches takes ``m + depth - 1``
    slots of its widest stage (its bubble is ``depth - 1`` of them), a slot is that stage's share of the model (its
    layers, weighed by ``layer_costs`` where given, as ``parts`` splits them), and the slowest pipeline (the one with
    the most micro-batches) sets the step. Communication is left out: it is what the preferred depth pays."""
    micro = config.micro_batches(pipelines)
    parts = config.parts(depth)
    costs = config.layer_costs or (1.0,) * config.layers
    widest = max(sum(costs[a:b]) for a, b in zip(parts, parts[1:], strict=False)) / sum(costs)
    return (max(micro) + depth - 1) * widest / sum(micro)


def shape_for(nodes: int, config: PolicyConfig) -> tuple[int, int]:
    """``(pipelines, depth)`` for ``nodes`` usable nodes.

    The preferred depth (``config.stages``; one pipeline as deep as the nodes when fewer), unless it leaves nodes
    idle and a shallower depth, not below ``min_stages`` nor below 2 (a replica needs a second stage), trains more of
    them in less time per micro-batch (``step_units``). Four nodes at a preferred depth of 3 make 2 x 2, not 1 x 3
    and an idle node; six make 2 x 3, as they divide. The layers must fit the shallower stages, as ``min_stages``
    promises: that is what it means.
    """
    if nodes < config.stages:
        return (1 if nodes else 0), nodes
    best = _pipelines(nodes, config.stages, config), config.stages
    for depth in range(config.stages - 1, max(config.min_stages, 2) - 1, -1):
        pipelines = _pipelines(nodes, depth, config)
        if pipelines * depth > best[0] * best[1] and step_units(pipelines, depth, config) < step_units(*best, config):
            best = pipelines, depth
    return best


def _rebuild(
    old: Placement | None,
    usable: Sequence[str],
    standby: Sequence[str],
    pipelines: int,
    stages: int,
    config: PolicyConfig,
    domains: Mapping[str, str] | None = None,
) -> Placement:
    """A ``pipelines x stages`` layout of ``usable`` nodes that keeps old placements where it can."""
    if old is None or old.stages != stages:
        # a new depth re-splits the layers: every node receives new layers; keep the old order
        return fresh_placement(list(usable), pipelines, stages, config, domains)
    alive = set(usable)
    # keep the pipelines with the most live nodes; their live nodes stay where they are
    ranked = sorted(range(old.pipelines), key=lambda p: (-sum(n in alive for n in old.grid[p]), p))
    kept = ranked[:pipelines]
    rows: list[list[str | None]] = [[n if n in alive else None for n in old.grid[p]] for p in kept]
    placed = {n for row in rows for n in row if n is not None}
    # donors: live nodes of dissolved pipelines (by the stage they hold), then standby nodes
    donors_by_stage: dict[int, list[str]] = {}
    for p in ranked[pipelines:]:
        for s, n in enumerate(old.grid[p]):
            if n in alive:
                donors_by_stage.setdefault(s, []).append(n)
    spare = [n for n in standby if n not in placed]
    while len(rows) < pipelines:
        rows.append([None] * stages)
    # a hole is filled first by a node already holding that stage, then by a standby node,
    # then by any other donor
    for row in rows:
        for s in range(stages):
            if row[s] is None and donors_by_stage.get(s):
                row[s] = donors_by_stage[s].pop(0)
    leftovers = spare + [n for s in sorted(donors_by_stage) for n in donors_by_stage[s]]
    for s in range(stages):  # column by column, as in fresh_placement
        for row in rows:
            if row[s] is None:
                row[s] = leftovers.pop(0)
    full = [[n for n in row if n is not None] for row in rows]
    holds = {n: s for row in old.grid for s, n in enumerate(row) if n in alive}
    grid = place_for(full, config.redundancy, leftovers, machine_in(domains), holds)
    return Placement(grid, config.parts(stages), config.micro_batches(pipelines))


def moved_nodes(old: Placement | None, new: Placement | None) -> tuple[str, ...]:
    """Nodes of ``new`` that run layers they did not run in ``old`` (they must receive them)."""
    if new is None:
        return ()
    moved = []
    for n in new.nodes:
        if old is None or n not in old.nodes or old.stage_layers(n) != new.stage_layers(n):
            moved.append(n)
    return tuple(moved)


def reconfigure(
    live: Iterable[str],
    standby: Iterable[str],
    layout: Placement | None,
    overloaded: Iterable[str],
    config: PolicyConfig,
    domains: Mapping[str, str] | None = None,
) -> Decision:
    """Decide the next layout.

    ``live``: every node that is up and ready (layout nodes and standby nodes); a layout node not
    in ``live`` is lost. ``standby``: live nodes outside the layout, waiting. ``overloaded``: layout
    nodes that run their lost successor's stage besides their own. ``domains`` (optional): a
    failure domain per node (zone, or the batch a node was started with; default: the machine in the
    node's name, ``machine_of``). Every layout the decision builds keeps each pair of nodes whose joint
    loss is fatal (a node and its replica holder; stage 0's node and stage ``S - 2``'s) on two domains,
    so one event does not take out both; where the nodes at hand cannot, it has the fewest such pairs
    and ``Decision.warning`` says which and why.
    """
    live_list, standby_list, over_list = list(live), list(standby), list(overloaded)
    _check_names("live", live_list)
    _check_names("standby", standby_list)
    _check_names("overloaded", over_list)
    alive = set(live_list)
    if missing := [n for n in standby_list if n not in alive]:
        raise PolicyError(f"standby nodes must be live (not live: {missing}); drop them from standby")
    layout_nodes = set(layout.nodes) if layout is not None else set()
    if both := [n for n in standby_list if n in layout_nodes]:
        raise PolicyError(
            f"a node is either in the layout or standby, not both (both: {both}); fix the caller"
        )
    if stray := [n for n in live_list if n not in layout_nodes and n not in standby_list]:
        raise PolicyError(
            f"every live node must be in the layout or standby (neither: {stray}); list them as standby"
        )
    for n in over_list:
        if layout is None or n not in layout_nodes or n not in alive:
            raise PolicyError(f"overloaded node {n!r} must be a live layout node; drop it from overloaded")
        if layout.successor(n) in alive:
            raise PolicyError(
                f"node {n!r} is reported overloaded but its successor {layout.successor(n)!r} is live; "
                "only the replica holder of a lost node is overloaded"
            )
    over = set(over_list)

    usable = [n for n in (layout.nodes if layout is not None else ()) if n in alive] + standby_list
    pref = config.stages
    pipelines, depth = shape_for(len(usable), config)
    if depth < config.min_stages:
        if layout is None:
            return Decision(
                "suspend", None, f"{len(usable)} nodes, fewer than min_stages={config.min_stages}"
            )
        return Decision(
            "suspend",
            None,
            f"{len(usable)} usable nodes left, the model needs at least min_stages={config.min_stages}",
        )

    def build(action: str, reason: str, p: int = pipelines, d: int = depth) -> Decision:
        new = _rebuild(layout, usable, standby_list, p, d, config, domains)
        warning = apart_warning(new.grid, usable, machine_in(domains), where=f"the {action} layout",
                                kept=kept_in_rows(new.grid, config.redundancy, machine_in(domains)))
        return Decision(action, new, reason, moved_nodes(layout, new), warning)

    if layout is None:
        return build("start", f"{len(usable)} nodes: {pipelines} x {depth}")

    lost = [n for n in layout.nodes if n not in alive]
    uncovered = [n for n in lost if layout.replica_holder(n) not in over]
    if uncovered:
        return build(
            "recover",
            f"stages of {uncovered} lost with their replica holders: rebuild {pipelines} x {depth} from a checkpoint",
        )
    if layout.stages < pref == depth:
        return build("change_depth", f"{len(usable)} nodes are back: depth {layout.stages} -> {pref}")
    if layout.stages == 1 < depth:  # one stage has no replica (a lone survivor restarted): cover it at once
        return build("change_depth", f"one stage has no replica; {len(usable)} nodes: depth 1 -> {depth}")
    if not lost and standby_list and layout.pipelines == 1 and layout.stages < depth:
        # one pipeline below its preferred depth: every node that joins is used at once (a job grows past its start)
        return build("change_depth", f"{len(standby_list)} node(s) joined: depth {layout.stages} -> {depth}")
    if not lost and depth != layout.stages and pipelines * depth > len(layout.nodes):
        # the preferred depth would leave live nodes idle: pipelines of another depth train every one (or more)
        return build("change_depth", f"{len(usable)} usable nodes: {layout.pipelines} x {layout.stages} -> "
                                     f"{pipelines} x {depth} trains {pipelines * depth} of them in a shorter step")
    if lost and len(standby_list) >= len(lost):
        if pipelines > layout.pipelines and depth == layout.stages:
            return build(
                "add_pipeline", f"{len(standby_list)} standby nodes relieve {len(lost)} and add pipelines"
            )
        if pipelines * depth > len(layout.nodes):
            # relieving keeps the layout's shape and leaves standby nodes idle: build the shape that trains them all
            # now, not in a second reconfiguration a step later
            return build("change_depth", f"{len(standby_list)} standby nodes relieve {len(lost)}; {len(usable)} usable "
                                         f"nodes: {layout.pipelines} x {layout.stages} -> {pipelines} x {depth}")
        return build(
            "rebalance",
            f"{len(standby_list)} standby nodes relieve {len(over)} overloaded nodes",
            layout.pipelines,
            layout.stages,
        )
    if depth == layout.stages and pipelines > layout.pipelines:
        return build(
            "add_pipeline", f"{len(usable)} usable nodes: {layout.pipelines} -> {pipelines} pipelines"
        )
    active = len(layout.nodes) - len(lost)
    if lost and 2 * len(over) / active > config.max_overloaded_fraction:
        return build(
            "restore_redundancy",
            f"2*{len(over)} overloaded / {active} active > {config.max_overloaded_fraction}: "
            f"rebuild {pipelines} x {depth}",
        )
    return Decision("keep", layout, "no rule applies" if not lost else f"{len(over)} overloaded, within risk")


def check_rebalancer(name: str, stages: Any, min_stages: Any, max_overloaded_fraction: Any) -> None:
    """The rebalancer's arguments (``runtime.rebalance.Rebalancer``), checked: ``BambooConfigError`` naming the rule."""
    if stages is not None and (isinstance(stages, bool) or not isinstance(stages, int) or stages < 1):
        raise BambooConfigError(f"{name}(stages={stages!r}): the preferred depth must be >= 1 (an integer), or None")
    if isinstance(min_stages, bool) or not isinstance(min_stages, int) or min_stages < 1:
        raise BambooConfigError(f"{name}(min_stages={min_stages!r}) must be >= 1 (an integer)")
    if not isinstance(max_overloaded_fraction, (int, float)) or not 0.0 <= max_overloaded_fraction <= 1.0:
        raise BambooConfigError(f"{name}(max_overloaded_fraction={max_overloaded_fraction!r}) must be in [0, 1]; use "
                                "e.g. 0.05")


def rebalance_arguments(entry: Any, name: str) -> dict[str, Any] | None:
    """A config's rebalancing entry as the rebalancer's arguments (None for ``false``): ``true`` for the defaults, or
    a dict of ``stages``, ``min_stages``, ``max_overloaded_fraction``, ``admit``; checked, ``name`` in the errors."""
    if entry is False or entry is None:
        return None
    if entry is True:
        return {}
    if not isinstance(entry, dict):
        raise BambooConfigError(f"{name} must be true, false or a dict of stages, min_stages, max_overloaded_fraction "
                                f'and admit (got {entry!r}); e.g. "rebalance": {{"stages": 4}}')
    known = ("stages", "min_stages", "max_overloaded_fraction", "admit")
    unknown = sorted(set(entry) - set(known))
    if unknown:
        raise BambooConfigError(f"unknown keys in {name}: {unknown}; known keys: {list(known)}")
    check_rebalancer("Rebalancer", entry.get("stages"), entry.get("min_stages", 2),
                     entry.get("max_overloaded_fraction", 0.05))
    return dict(entry)
