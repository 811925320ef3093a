"""Non-tensor values as JSON: what `inspect --json` shows and the safetensors formats' sidecars.

JSON has no tuples, bytes or arbitrary objects; tuples become lists (the sidecar keeps the type
name beside), bytes are shown by their length, anything else by its `repr()`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hpckpt.core.safety.pickle_budget import describe


#: Values from pickles nest at most `pickle_budget` depth (100 by default, at most 200); anything
#: deeper (a value from elsewhere) is cut here rather than overflow the recursion limit.
MAX_DEPTH = 256


def jsonable(value: Any, depth: int = 0) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth >= MAX_DEPTH:
        return f"<{type(value).__name__} nested deeper than {MAX_DEPTH} levels>"
    if isinstance(value, (list, tuple)):
        return [jsonable(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": len(value)}
    if type(value).__name__ in ("DType", "TorchDevice"):  # a torch dtype or device: torch's spelling
        return str(value) if type(value).__name__ == "TorchDevice" else f"torch.{value}"
    return _bounded_repr(value)


def _bounded_repr(value: Any) -> str:
    """`repr()`, which recurses into an object's fields: a value too deep for it is described."""
    try:
        return repr(value)
    except RecursionError:
        return describe(value)


def values_document(values: Mapping[str, Any]) -> dict:
    """`{fqn: {"type", "value"}}`, the sidecar of a safetensors or Hugging Face output."""
    return {fqn: {"type": type(v).__name__, "value": jsonable(v)} for fqn, v in values.items()}
