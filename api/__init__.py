"""The library entry points, one module per command; the CLI is a thin layer over these.

Each returns a frozen report (`api.reports`) that renders exactly what `hpckpt ... --json` prints
and can be read like that document (`report["bytes_written"]`).

    from hpckpt import api
    api.inspect("ckpt/")["counts"]
    api.reshard("ckpt/", "ckpt-8/", LayoutSpec.for_world_size(8))
    api.consolidate("ckpt/", "model.safetensors", select=api.Selection.of(include=["model.*"]), dtype="bf16")
    api.convert("net.ckpt", "net.pt", rules="ms-to-torch")
"""

from hpckpt.api.checksum import checksum
from hpckpt.api.consolidate import consolidate
from hpckpt.api.convert import convert, ms_torch_target, rename
from hpckpt.api.diff import DiffReport, diff
from hpckpt.api.inspect import inspect, rank_of
from hpckpt.api.layouts import keep_layout_spec, source_layout
from hpckpt.api.options import Selection, parse_size
from hpckpt.api.reports import ChecksumReport, FinalizeReport, InspectReport, Report, VerifyReport, WriteReport
from hpckpt.api.reshard import finalize, reshard
from hpckpt.api.verify import verify
from hpckpt.core.io.write import Progress, WriteSettings

__all__ = [
    "inspect", "verify", "checksum", "diff", "DiffReport", "reshard", "finalize", "consolidate", "convert", "ms_torch_target", "rename",
    "keep_layout_spec", "source_layout", "rank_of", "parse_size",
    "Selection", "WriteSettings", "Progress",
    "Report", "ChecksumReport", "WriteReport", "FinalizeReport", "InspectReport", "VerifyReport",
]
