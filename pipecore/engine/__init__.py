"""The training engine: real tensors through the same executor and stage worker as the simulator."""

from .graph import CaptureError
from .optim import SGD, AdamW, NAdam
from .pipeline import Pipeline
from .losses import NonFiniteLoss

__all__ = ["AdamW", "CaptureError", "NAdam", "NonFiniteLoss", "Pipeline", "SGD"]
