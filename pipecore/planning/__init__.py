"""Planning stages for time and memory: per-node costs of the captured graph, a memory model per stage and
algorithm, and partitioners (DawnPiper's memory-aware binary partitioning among them)."""

from .costs import GraphCosts, TiedParameter, ValueCost
from .memory import Choice, Sizing, StageFit, StageMemory, StageModel, fit_stage, stage_memory, stage_time
from .partitioners import OBJECTIVES, InfeasibleMemoryLimit, Partition, partition, smallest_memory_limit
from .planner import Plan, plan_costs
from .api import parse_bytes, plan
from .profiler import profile

__all__ = [
    "Choice", "GraphCosts", "InfeasibleMemoryLimit", "OBJECTIVES", "Partition", "Plan", "Sizing", "StageFit",
    "StageMemory", "StageModel", "fit_stage", "parse_bytes", "partition", "plan", "plan_costs", "profile",
    "smallest_memory_limit", "stage_memory", "stage_time", "TiedParameter", "ValueCost",
]
