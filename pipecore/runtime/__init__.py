"""The runtime: stage workers and executors (local now; the same worker serves every transport)."""

from .executor import Costs, Event, Executor
from .worker import ActionRecord, Message, StageWorker

__all__ = ["ActionRecord", "Costs", "Event", "Executor", "Message", "StageWorker"]
