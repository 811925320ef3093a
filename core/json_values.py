"""Non-tensor values as JSON: what `inspect --json` shows and the safetensors formats' sidecars.

JSON has no tuples, bytes or arbitrary objects; tuples become lists (the sidecar keeps the type
name beside), bytes are shown by their length, anything else by its `repr()`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": len(value)}
    if type(value).__name__ in ("DType", "TorchDevice"):  # a torch dtype or device: torch's spelling
        return str(value) if type(value).__name__ == "TorchDevice" else f"torch.{value}"
    return repr(value)


def values_document(values: Mapping[str, Any]) -> dict:
    """`{fqn: {"type", "value"}}`, the sidecar of a safetensors or Hugging Face output."""
    return {fqn: {"type": type(v).__name__, "value": jsonable(v)} for fqn, v in values.items()}
