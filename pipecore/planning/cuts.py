"""Where the captured graph is cut into stages: the pipeline's ``partition`` argument checked against the graph
(cut points, or a :class:`~pipecore.planning.Plan`'s cuts), or the default partition, balanced by parameters
over the model's modules."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from torch import nn

from .cut_search import balanced_by_parameters
from .planner import Plan

# For annotations only: loading pipecore.engine here would load its pipeline, which imports this module.
if TYPE_CHECKING:
    from ..engine.graph import CapturedModel


def stage_starts(captured: CapturedModel, num_stages: int, partition: Sequence[int | str] | Plan | None) -> list[int]:
    """Validated compute-node indices where stages ``1..P-1`` start.

    ``partition`` may be a :class:`~pipecore.planning.Plan` (``pipecore.plan``): its cuts.

    ``partition`` lists cut points (node indices or module names). By default the graph is cut only where a
    module starts (a child of the model, or an item of a ``ModuleList``/``Sequential`` it holds: for the
    GPT, each block), balanced by parameter count; such cuts keep a module's internal values, shape
    arithmetic included, inside one stage.
    """
    n = len(captured.nodes)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if isinstance(partition, Plan):
        return _plan_starts(partition, num_stages, n)
    if partition is None:
        units = module_units(captured)
        if num_stages > len(units):
            raise ValueError(f"num_stages={num_stages} is larger than the number of modules the captured graph can be "
                             f"cut between ({len(units)}); each stage needs one. Pass partition= with node indices "
                             f"to cut inside modules (see Pipeline.describe())")
        starts = [a for a, _ in units]
        sizes = captured.node_parameters()
        unit_sizes = [sum(sizes[a:b]) for a, b in units]
        return [starts[i] for i in balanced_by_parameters(unit_sizes, num_stages)]
    points = list(partition)
    if len(points) != num_stages - 1:
        raise ValueError(
            f"partition must list {num_stages - 1} cut points (where stages 1..{num_stages - 1} start), got {points}"
        )
    if num_stages > n:
        raise ValueError(f"num_stages={num_stages} is larger than the number of nodes in the captured graph ({n})")
    starts = [captured.cut_index(p) for p in points]
    if any(a >= b for a, b in zip(starts, starts[1:])):
        raise ValueError(f"partition {points} must cut the graph at strictly increasing positions, got node indices "
                         f"{starts}")
    return starts


def module_units(captured: CapturedModel) -> list[tuple[int, int]]:
    """The node ranges ``[a, b)`` that start where a module starts: the default partition's units."""
    containers = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
    root = captured.model

    def stack_holder(module: nn.Module) -> bool:
        """A module that holds a stack of layers (a ``ModuleList``) below it, such as Hugging Face's
        ``GPT2Model`` (``transformer.h``) or ``BertModel`` (``bert.encoder.layer``): its units are its parts."""
        return not isinstance(module, containers) and any(isinstance(m, nn.ModuleList) for m in module.modules())

    def unit(name: str | None) -> str | None:
        if name is None:
            return None
        parts, module = [], root
        for part in name.split("."):
            parts.append(part)
            module = module.get_submodule(part) if module is not None and hasattr(module, "get_submodule") else None
            if module is None or not (isinstance(module, containers) or stack_holder(module)):
                break
        else:
            if module is not None and stack_holder(module):
                return None  # the own code of a module holding a stack (masks, positions) joins the unit before it
        return ".".join(parts)

    # A new unit starts where a module starts; the model's own code before the first module (an input
    # reshape) joins the first module's unit rather than making a unit without parameters.
    starts, previous = [0], unit(captured.module_of(captured.nodes[0]))
    seen_module = previous is not None
    for i, node in enumerate(captured.nodes[1:], 1):
        current = unit(captured.module_of(node))
        if current is not None and current != previous:
            if seen_module:
                starts.append(i)
            seen_module = True
        previous = current
    return list(zip(starts, starts[1:] + [len(captured.nodes)]))


def _plan_starts(plan: Plan, num_stages: int, nodes: int) -> list[int]:
    """The cuts of a :class:`~pipecore.planning.Plan`, checked against this pipeline's graph and stages."""
    if plan.num_stages != num_stages:
        raise ValueError(f"the plan cuts {plan.num_stages} stages but the pipeline has num_stages={num_stages}")
    if len(plan.costs) != nodes:
        raise ValueError(f"the plan was made for a graph of {len(plan.costs)} nodes, this model captures {nodes}: "
                         "plan the same model (and leaf_modules) as the pipeline trains")
    return list(plan.starts)
