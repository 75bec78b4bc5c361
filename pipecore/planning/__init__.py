"""Planning stages for time and memory: per-node costs of the captured graph, a memory model per stage and
algorithm, and partitioners (DawnPiper's memory-aware binary partitioning among them)."""

from .costs import GraphCosts, TiedParameter, ValueCost
from .memory import Choice, Sizing, StageFit, StageMemory, StageModel, fit_stage, stage_memory, stage_time
from .partitioners import OBJECTIVES, InfeasibleMemoryLimit, Partition, partition, smallest_memory_limit
from .planner import Plan, plan_costs
from .api import plan
from .byte_units import parse_bytes
from .profiler import profile
from .bandwidth import Bandwidth, measure_allreduce
from .world import Configuration, World, plan_world

__all__ = [
    "Bandwidth", "Choice", "Configuration", "GraphCosts", "InfeasibleMemoryLimit", "OBJECTIVES", "Partition", "Plan",
    "Sizing", "StageFit", "StageMemory", "StageModel", "fit_stage", "measure_allreduce", "parse_bytes", "partition",
    "plan", "plan_costs", "plan_world", "profile", "smallest_memory_limit", "stage_memory", "stage_time",
    "TiedParameter", "ValueCost", "World",
]
