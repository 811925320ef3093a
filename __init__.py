"""hpckpt: one engine for distributed training checkpoints.

Inspect, verify, reshard, convert and consolidate HyperParallel DCP, PyTorch DCP, MindSpore and
safetensors checkpoints, streaming in bounded memory and never running code from a checkpoint.
"""

__version__ = "0.1.0"
