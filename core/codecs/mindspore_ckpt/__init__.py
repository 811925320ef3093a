"""MindSpore `.ckpt` files: an index built by walking the protobuf fields, and what a writer needs.

Facts (MindSpore 2.10, `train/serialization.py` and `checkpoint.proto`):

* The file is a protobuf `Checkpoint { repeated Value value = 1 }`, written as one serialized
  one-Value `Checkpoint` after another. `Value { required string tag = 1; oneof { TensorProto
  tensor = 2; MapTensorProto maptensor = 3 } }`, `TensorProto { repeated int64 dims = 1;
  required string tensor_type = 2; required bytes tensor_content = 3 }`. Content is raw
  little-endian row-major data, unaligned.
* Split rule: a tensor is written as consecutive Values with the same tag and the full dims.
  Synchronous saves (Parameters/Tensors, the default) cut the raw bytes every
  `1024 * SLICE_SIZE` bytes (512 MiB), so pieces need not hold whole rows. Asynchronous saves
  (numpy data) use `np.array_split(array, ceil(nbytes / 512 MiB))` along axis 0: whole rows, and
  possibly empty pieces. The loader concatenates the run's contents, so both are read here as
  flat byte intervals of the tensor, each cut into N-D boxes.
* `dims == [0]` with one element of content loads as a 0-d tensor (the loader's rule); 0-d
  tensors are written with no dims. Zero-element tensors are not written at all.
* `str` values: `tensor_type "str"`, `dims [0]`, content = numpy `<U` bytes (UTF-32-LE, trailing
  NULs dropped on load). `Int4` (qint4x2, two nibbles per byte) and maptensors are not read.
* CRC (`crc_check=True`): the file ends with `b"crc_num"` and the CRC-32 (`binascii.crc32`, start
  0) of every byte before that marker, as 10 bytes big-endian. The loader strips such a trailer
  whenever `pb_content[-17:-10] == b"crc_num"`, checked or not.
* Encryption (`enc_key`): the whole stream is replaced by blocks that each start with a 4-byte
  little-endian magic, 0x7F3A5ED8 (AES-GCM), 0x7F3A5ED9 (AES-CBC), 0x7F3A5EDA (SM4-CBC). A plain
  `.ckpt` always starts with 0x0A (field 1, length-delimited), so the two never collide.

Modules: `wire` (the protobuf fields, both ways), `scan` (what a walk finds, single reads),
`crc` (the trailer's check, streamed, once per file), `sniff` (telling a `.ckpt` by its first
bytes). No torch or mindspore import: this package is on the CLI's start-up path.
"""

from __future__ import annotations

from hpckpt.core.codecs.mindspore_ckpt.crc import CrcGate, verify_crc  # noqa: F401
from hpckpt.core.codecs.mindspore_ckpt.scan import (  # noqa: F401  (the reading API)
    _BY_SPELLING,
    CRC_MARK,
    CRC_TRAILER_BYTES,
    STRING_TYPE,
    CkptScan,
    CkptString,
    CkptTensor,
    CkptUnsupported,
    Piece,
    decode_string,
    read_string,
    scan,
)
from hpckpt.core.codecs.mindspore_ckpt.sniff import ENCRYPTION_MAGICS, encryption_mode, sniff  # noqa: F401
from hpckpt.core.codecs.mindspore_ckpt.wire import piece_header  # noqa: F401
from hpckpt.core.dtypes import DType
from hpckpt.core.errors import UnsupportedDTypeError

#: Bytes per Value when a tensor is split (MindSpore: `1024 * SLICE_SIZE`, SLICE_SIZE in KiB).
#: Read when a writer lays a file out, so tests can lower it.
SPLIT_BYTES = 512 * 1024 * 1024


def writable_spelling(dtype: DType, fqn: str | None = None) -> str:
    """The tensor_type MindSpore's loader reads for `dtype`: never one it refuses.

    MindSpore 2.10's `load_checkpoint` accepts Bool, Int8-Int64, UInt8-UInt64, Float16, BFloat16,
    Float32, Float64 (and str, Int4) and fails on anything else, Complex64/128 and Float8E4M3FN,
    Float8E5M2, HiFloat8 included (checked by loading each; `tests/test_mindspore_ckpt_integrity.py`).

    Raises:
        UnsupportedDTypeError: `dtype` is none of those (complex, float8).
    """
    if dtype.mindspore not in _BY_SPELLING:  # None included: it is no key
        what = f"{fqn!r} is {dtype}: " if fqn else ""
        raise UnsupportedDTypeError(
            f"{what}a MindSpore .ckpt cannot hold {dtype} tensors (MindSpore's load_checkpoint reads "
            f"{', '.join(sorted(_BY_SPELLING))} only)",
            hint="leave it out with --exclude" + (", or cast it with --dtype" if dtype.is_floating else ""),
        )
    return dtype.mindspore

