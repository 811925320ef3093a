"""The formats a running job's save writes: HyperParallel (the default, the format hpckpt exists
for) and PyTorch DCP (what torch's own `dcp.load` reads). Planning, de-dup, staging, the commit
and the manifest are the same for both; a format gives what differs: the bytes a rank makes of
each of its values, the writer of its files and the reader that checks the staged output before
the commit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpckpt.converters.base import WriterOptions
from hpckpt.converters.hyperparallel.reader import HyperParallelReader
from hpckpt.converters.hyperparallel.writer import HyperParallelWriter, value_payload
from hpckpt.converters.torch_dcp.reader import TorchDcpReader
from hpckpt.converters.torch_dcp.writer import TorchDcpWriter, value_archive
from hpckpt.core.safety.unpickle import loads


@dataclass(frozen=True)
class OutputFormat:
    name: str
    payload: Callable[[Any, str], bytes]  # (value, fqn) -> what a rank stores of it; raises if it cannot
    cannot: str  # why a value `payload` refused cannot be saved
    writer: Callable[..., Any]  # (framework, value_lengths, payloads) -> a FormatWriter
    reader: Callable[[], Any]
    rank_local: bool  # coordination="none" (`{rank}.metadata`) exists in this format


def _hyperparallel_payload(value: Any, fqn: str) -> bytes:
    payload = value_payload(value, fqn)
    loads(payload, what=f"value {fqn}")  # what hpckpt's safe unpickler would not read back is refused now
    return payload


FORMATS = {
    "hyperparallel": OutputFormat(
        "hyperparallel", _hyperparallel_payload, "hpckpt's safe unpickler would not read it back",
        lambda framework, lengths, payloads: HyperParallelWriter(WriterOptions(framework=framework),
                                                                 value_lengths=lengths, payloads=payloads),
        HyperParallelReader, rank_local=True),
    "torch-dcp": OutputFormat(
        "torch-dcp", lambda value, fqn: value_archive(fqn, value), "a torch.save record cannot hold it",
        lambda framework, lengths, payloads: TorchDcpWriter(WriterOptions(framework=framework),
                                                            value_lengths=lengths, payloads=payloads),
        TorchDcpReader, rank_local=False),
}


def output_format(name: str, coordination: str) -> OutputFormat:
    """Raises ValueError: no such format, or one without a rank-local layout for coordination="none"."""
    if name not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {name!r}")
    chosen = FORMATS[name]
    if coordination == "none" and not chosen.rank_local:
        raise ValueError(f"coordination='none' writes HyperParallel's rank-local metadata; format={name!r} needs "
                         "coordination='collectives' or 'storage'")
    return chosen

