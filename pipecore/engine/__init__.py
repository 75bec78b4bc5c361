"""The training engine: real tensors through the same executor and stage worker as the simulator."""

from .optim import SGD, AdamW
from .pipeline import Pipeline
from .stage import NonFiniteLoss

__all__ = ["AdamW", "NonFiniteLoss", "Pipeline", "SGD"]
