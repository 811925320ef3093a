"""PyTorch Distributed Checkpoint (DCP): `.metadata` plus `__{rank}_{i}.distcp` files, read and
written without importing torch (`reader`, `writer`, and `metadata_pickle` for the `.metadata`)."""

from hpckpt.converters.torch_dcp.reader import TorchDcpReader
from hpckpt.converters.torch_dcp.writer import TorchDcpWriter

__all__ = ["TorchDcpReader", "TorchDcpWriter"]
