"""A model-shaped state of a given size: what `hpckpt run save --size` and `bench --size` save.

The tensors are those of a decoder-only transformer (embedding, per layer four attention
projections, a gated MLP and two norms, a final norm and an output head), in the requested
dtype, plus Adam's two moments per weight in float32 and a 0-d step, so a checkpoint's mix of
large matrices, small vectors and values is like a real one. The hidden size grows with the
size asked for; the layer count fills the rest.

Values are a function of each element's global position (`values`), so every rank can make
its own box alone and replicas agree, and a reader can tell a misplaced box.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hpckpt.core.dtypes import DType, dtype as parse_dtype
from hpckpt.core.geometry.box import Box

MOMENT = parse_dtype("float32")


@dataclass(frozen=True)
class TensorSpec:
    fqn: str
    shape: tuple[int, ...]
    dtype: DType
    path: tuple  # where it goes in the nested state dict


def model_shape(nbytes: int, dtype: DType) -> tuple[int, int, int]:
    """(hidden, layers, vocab) of a model whose weights and moments take about `nbytes`."""
    per_param = dtype.itemsize + 2 * MOMENT.itemsize
    params = max(nbytes // per_param, 1)
    hidden = 64
    while True:  # layers ~ hidden / 64, as in common model families
        nxt = hidden + 64
        if _params(nxt, max(2, nxt // 64), min(32000, 8 * nxt)) > params:
            break
        hidden = nxt
    vocab = min(32000, 8 * hidden)
    fixed = _params(hidden, 0, vocab)
    layers = max(1, (params - fixed) // _layer_params(hidden))
    return hidden, int(layers), vocab


def _layer_params(h: int) -> int:
    f = _ffn(h)
    return 4 * h * h + 3 * h * f + 2 * h


def _params(h: int, layers: int, vocab: int) -> int:
    return 2 * vocab * h + h + layers * _layer_params(h)


def _ffn(h: int) -> int:
    return int(math.ceil(8 * h / 3 / 64) * 64)


def tensors(nbytes: int, dtype: DType) -> list[TensorSpec]:
    """Every tensor of the synthetic state, weights first, then their moments."""
    h, layers, vocab = model_shape(nbytes, dtype)
    f = _ffn(h)
    weights = [("embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"layers.{i}."
        weights += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (h, h)),
                    (p + "self_attn.v_proj.weight", (h, h)), (p + "self_attn.o_proj.weight", (h, h)),
                    (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                    (p + "mlp.down_proj.weight", (h, f)), (p + "input_layernorm.weight", (h,)),
                    (p + "post_attention_layernorm.weight", (h,))]
    weights += [("norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    out = [TensorSpec(f"model.{n}", s, dtype, ("model", n)) for n, s in weights]
    for moment in ("exp_avg", "exp_avg_sq"):
        out += [TensorSpec(f"optim.state.{n}.{moment}", s, MOMENT, ("optim", "state", n, moment)) for n, s in weights]
    return out


def state_values() -> dict[tuple, object]:
    """The non-tensor entries: an optimizer step and its hyper-parameters."""
    return {("optim", "step"): 100, ("optim", "param_groups", "lr"): 3e-4,
            ("optim", "param_groups", "betas"): (0.9, 0.95), ("optim", "param_groups", "name"): "adamw"}


def values(spec: TensorSpec, box: Box) -> np.ndarray:
    """The box's elements as float32 (exact in bfloat16 and float16): a small integer pattern of
    the global element index, scaled, so neighbouring elements and boxes differ."""
    index = np.zeros(box.sizes, dtype=np.int64)
    stride = 1
    for d in range(len(box.sizes) - 1, -1, -1):
        axis = np.arange(box.offsets[d], box.offsets[d] + box.sizes[d], dtype=np.int64) * stride
        index += axis.reshape([-1 if k == d else 1 for k in range(len(box.sizes))])
        stride *= spec.shape[d]
    seed = sum(spec.fqn.encode()) % 61
    return (((index * 7 + seed) % 251) - 125).astype(np.float32) / 64
