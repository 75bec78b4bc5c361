"""The runtime: stage workers and executors (local now; the same worker serves every transport)."""

from .executor import Costs, Event, Executor
from .transport import LocalTransport, Transport
from .worker import ActionRecord, Message, StageWorker

__all__ = ["ActionRecord", "Costs", "Event", "Executor", "LocalTransport", "Message", "StageWorker", "Transport"]
