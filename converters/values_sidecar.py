"""The JSON sidecar of the safetensors formats: non-tensor values beside the tensors.

safetensors holds tensors only, so a safetensors file's values go to `NAME.values.json` and a
Hugging Face directory's to `values.json`, as `{fqn: {"type", "value"}}`. Both readers read the
sidecar back, so values survive a round trip. JSON cannot hold everything a pickle can: a tuple
is kept by its type name, bytes as base64; whatever does not come back equal and of the same type
(a tuple inside a list, a dict with int keys, an object shown by its repr) is reported by the
writer as `converted`, never passed off as the same value.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpckpt.core.errors import CorruptMetadataError
from hpckpt.core.index import ValueEntry
from hpckpt.core.json_values import values_document
from hpckpt.core.safety import input_files
from hpckpt.core.storage.urls import lexists

#: A sidecar larger than this is not ours (values are small): refused rather than parsed.
MAX_SIDECAR_BYTES = input_files.MAX_SIDECAR_BYTES


def _document(values: Mapping[str, Any]) -> dict:
    """Strict JSON (no NaN or Infinity tokens, which JSON does not have): a non-finite float is
    `{"float": "nan"}`; one nested deeper is kept as its repr (and so reported converted)."""
    document = values_document(values)
    for fqn, value in values.items():
        if isinstance(value, (bytes, bytearray)):
            document[fqn]["value"] = {"base64": base64.b64encode(bytes(value)).decode("ascii")}
        elif type(value) is float and not math.isfinite(value):
            document[fqn]["value"] = {"float": repr(value)}
        try:
            json.dumps(document[fqn], allow_nan=False)
        except ValueError:
            document[fqn]["value"] = repr(value)
    return document


def encode(values: Mapping[str, Any]) -> tuple[bytes, tuple[tuple[str, str], ...]]:
    """The sidecar's bytes, and `(fqn, reason)` of every value that would not read back as itself."""
    document = _document(values)
    data = (json.dumps(document, indent=1, allow_nan=False) + "\n").encode()
    back = json.loads(data)
    converted = tuple((fqn, f"{type(value).__name__} value kept in the JSON sidecar as "
                       f"{type(decode_one(back[fqn])).__name__} {_short(back[fqn]['value'])}")
                      for fqn, value in values.items() if not _same(decode_one(back[fqn]), value))
    return data, converted


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down (1 == 1.0 == True is not the same value)."""
    if type(a) is not type(b):
        return isinstance(a, bytes) and isinstance(b, bytearray) and a == b
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and a != a:
        return b != b  # NaN
    return a == b


def decode_one(item: Any) -> Any:
    """The value of one sidecar entry `{"type", "value"}`."""
    if not isinstance(item, dict) or "value" not in item:
        raise CorruptMetadataError("sidecar entry is not {\"type\", \"value\"}")
    kind, value = item.get("type"), item["value"]
    if kind == "tuple" and isinstance(value, list):
        return tuple(value)
    if kind in ("bytes", "bytearray") and isinstance(value, dict) and isinstance(value.get("base64"), str):
        try:
            return base64.b64decode(value["base64"], validate=True)
        except (ValueError, binascii.Error):
            raise CorruptMetadataError("sidecar entry's base64 is malformed") from None
    if kind == "float" and isinstance(value, dict) and value.get("float") in ("nan", "inf", "-inf"):
        return float(value["float"])
    return value


def read(path: Path) -> dict:
    """The sidecar's document (`{}` when there is none).

    Raises:
        CorruptMetadataError: not a JSON object of entries, or implausibly large.
    """
    if not lexists(path):
        return {}
    document = input_files.load_json(input_files.read_small(path, "values sidecar", MAX_SIDECAR_BYTES),
                                     f"{path}: values sidecar", max_depth=input_files.MAX_SIDECAR_DEPTH)
    if not isinstance(document, dict) or not all(isinstance(v, dict) for v in document.values()):
        raise CorruptMetadataError(f"{path}: not a JSON object of {{\"type\", \"value\"}} entries")
    return document


def value_entries(root: Path, name: str) -> dict[str, ValueEntry]:
    """The values of the sidecar `root/name`, as index entries (decoded on demand, `encoding="json"`)."""
    path = root / name
    return {fqn: ValueEntry(fqn, name, 0, path.stat().st_size, encoding="json") for fqn in read(path)}


SIDECAR_SUFFIX = ".values.json"


def sidecar_name(safetensors_name: str) -> str:
    return safetensors_name.removesuffix(".safetensors") + SIDECAR_SUFFIX


def sidecars_of(file_name: str) -> tuple[str, ...]:
    """The sidecars hpckpt may have written beside the single-file output `file_name` (its values,
    its manifest): replacing the file (`--force`) replaces them too, so that no old sidecar is
    read with a new file."""
    from hpckpt.core.commit import manifest

    values = (sidecar_name(file_name),) if file_name.endswith(".safetensors") else ()
    return (*values, manifest.sidecar_name(file_name))


def owner_of(name: str) -> str | None:
    """The file a sidecar named `name` belongs to (a safetensors file's values, any single file's
    manifest); None for any other name."""
    from hpckpt.core.commit import manifest

    if name.endswith(manifest.SUFFIX):
        return name.removesuffix(manifest.SUFFIX) or None
    stem = name.removesuffix(SIDECAR_SUFFIX)
    return f"{stem}.safetensors" if stem and stem != name else None
