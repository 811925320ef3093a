"""Making a rank's tensors for a job: a framework's tensor from float32 values or an empty one.

The jobs build their state in the launcher's framework (torchrun: torch, msrun: MindSpore), so
the same job saves and loads real tensors of either; the framework is imported only here and
in `hpckpt.dist.frameworks`.
"""

from __future__ import annotations

import numpy as np

from hpckpt.core.dtypes import DType


def _mindspore_dtype(dtype: DType):
    import mindspore

    return mindspore.bool_ if dtype.name == "bool" else getattr(mindspore, dtype.name)


def from_values(framework: str, values: np.ndarray, dtype: DType):
    """A tensor of `dtype` holding `values` (float32, exact in the target dtype)."""
    if framework == "torch":
        import torch

        return torch.from_numpy(np.ascontiguousarray(values)).to(getattr(torch, dtype.name))
    import mindspore

    return mindspore.Parameter(mindspore.Tensor(np.ascontiguousarray(values), dtype=_mindspore_dtype(dtype)),
                               requires_grad=False)


def empty(framework: str, shape: tuple[int, ...], dtype: DType):
    """A zero tensor to load into (a MindSpore Parameter, as a network holds its weights)."""
    if framework == "torch":
        import torch

        return torch.zeros(shape, dtype=getattr(torch, dtype.name))
    import mindspore

    host = np.zeros(shape, dtype=dtype.np if dtype.is_exact_in_numpy else np.float32)
    return mindspore.Parameter(mindspore.Tensor(host, dtype=_mindspore_dtype(dtype)), requires_grad=False)
