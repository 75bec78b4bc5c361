"""pipecore: pipeline-parallel training for PyTorch with first-class weight staleness."""

__version__ = "0.1.0"
