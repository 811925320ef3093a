"""Every dtype torch 2.13 and safetensors 0.8.0 define: copied bit for bit, or refused clearly.

The table's claims are checked against the real libraries: which safetensors codes `safe_open`
accepts, which dtypes `torch.save` / `torch.distributed.checkpoint.save` can write, which
tensor_types MindSpore's `load_checkpoint` reads. Conversions are compared as raw bytes
(`tensor.view(torch.uint8)`), sources written by torch, by safetensors, or by hand where no
library writes the dtype (F6).
"""

from __future__ import annotations

import json
import math
import pickle
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from hpckpt.cli.app import app
from hpckpt.core import dtypes
from hpckpt.core.codecs import safetensors_io
from hpckpt.core.safety import unpickle
from hpckpt.core.errors import UnsafePickleError, UnsupportedDTypeError

runner = CliRunner()
warnings.filterwarnings("ignore", category=UserWarning)

# The codes of safetensors 0.8.0's Rust `Dtype` enum (22 variants), read off the library.
ST_CODES = {"BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
            "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64",
            "F64", "I64", "U64"}
NOT_CODES = ("C128", "C32", "X9", "F8_E4M3FN", "I4", "U4", "Q8")
TORCH = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
COPIED = [d for d in dtypes.all_dtypes() if d.refusal is None and d.in_torch]
TARGETS = {"pt": "torch-save", "torch-dcp": "torch-dcp", "safetensors": "safetensors", "hf": "hf-sharded",
           "hp": "hyperparallel", "ms": "mindspore-ckpt"}
OUT = {"pt": "o.pt", "torch-dcp": "dcp", "safetensors": "o.safetensors", "hf": "hf", "hp": "hp", "ms": "o.ckpt"}


def _tensor(d: dtypes.DType, shape=(4, 6), seed=0) -> torch.Tensor:
    """Random bytes viewed as `d` (bool: 0/1), so every bit pattern is exercised."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (math.prod(shape) * d.itemsize,), dtype=torch.uint8, generator=g)
    if d.name == "bool":
        raw %= 2
    return raw.view(TORCH[d.name]).reshape(shape)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _raw_safetensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """key -> (code, header shape, bytes), parsed by hand (no hpckpt, no safetensors)."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], blob[8 + n + v["data_offsets"][0]: 8 + n + v["data_offsets"][1]])
            for k, v in header.items()}


def _hand_file(path: Path, entries: dict[str, tuple[str, list[int], bytes]]) -> None:
    header, position = {}, 0
    for key, (code, shape, data) in entries.items():
        header[key] = {"dtype": code, "shape": shape, "data_offsets": [position, position + len(data)]}
        position += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(d for _c, _s, d in entries.values()))


def _cli(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def _assert_refused(result, *names: str, code: int = 15) -> None:
    assert result.exit_code == code, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    for name in names:
        assert name in errors[0], (name, errors[0])


# --- the table against the libraries ------------------------------------------------------------


def test_the_table_holds_every_torch_dtype_with_torchs_item_size():
    assert {d.name for d in dtypes.all_dtypes() if d.in_torch} == set(TORCH)
    for alias, real in ((k, v) for k, v in vars(torch).items() if isinstance(v, torch.dtype)):
        d = dtypes.dtype(f"torch.{alias}")
        assert d.name == str(real).removeprefix("torch.") and d.itemsize == real.itemsize, alias


def test_safetensors_codes_are_exactly_those_safe_open_accepts(tmp_path):
    assert dtypes.SAFETENSORS_CODES == ST_CODES
    for code in sorted(ST_CODES) + list(NOT_CODES):
        d = dtypes.from_safetensors(code) if code in ST_CODES else None
        nbytes = 3 * d.itemsize if d else 24  # shape [4 * pack]: whole bytes for every code
        shape = [3 * (d.safetensors_pack if d else 1)]
        path = tmp_path / f"{code}.safetensors"
        _hand_file(path, {"t": (code, shape, bytes(nbytes))})
        try:
            with safe_open(path, "np"):
                accepted = True
        except Exception:  # noqa: BLE001 - the library's own refusal, whatever its class
            accepted = False
        assert accepted == (code in dtypes.SAFETENSORS_CODES), code


@pytest.mark.parametrize("d", [d for d in COPIED if d.safetensors], ids=str)
def test_safetensors_torch_writes_our_code_and_shape(tmp_path, d):
    t = _tensor(d)
    save_file({"t": t}, tmp_path / "a.safetensors")
    code, shape, data = _raw_safetensors(tmp_path / "a.safetensors")["t"]
    assert (code, shape, data) == (d.safetensors, safetensors_io.header_shape(d, tuple(t.shape)), _bytes(t))
    info = safetensors_io.read_header(tmp_path / "a.safetensors").entries["t"]
    assert (info.dtype, info.shape) == (d, tuple(t.shape))


@pytest.mark.parametrize("d", [d for d in dtypes.all_dtypes() if d.in_torch], ids=str)
def test_torch_save_and_dcp_can_hold_what_the_table_says(tmp_path, d):
    import torch.distributed.checkpoint as dcp

    t = torch.zeros(2, dtype=TORCH[d.name]) if d.refusal is None else torch.zeros(2, dtype=torch.uint8)
    if d.name.startswith(("qint", "quint")):
        t = torch.quantize_per_tensor(torch.arange(2.0), 1.0, 0, TORCH[d.name])
    elif d.refusal is not None:
        t = torch.zeros(2, dtype=TORCH[d.name])
    for fmt, save in (("torch-save", lambda: torch.save({"t": t}, tmp_path / "a.pt")),
                      ("torch-dcp", lambda: dcp.save({"t": t}, checkpoint_id=tmp_path / "dcp", no_dist=True))):
        try:
            save()
            saved = True
        except BaseException:  # noqa: BLE001 - DCP wraps the failure in a CheckpointException
            saved = False
        reason = dtypes.unsupported_reason(d, fmt)
        if d.name.startswith(("qint", "quint")):
            assert reason and "quantized" in reason  # torch saves them; hpckpt does not carry qparams
        else:
            assert saved == (reason is None), (fmt, reason)


def _ckpt(path: Path, tensor_type: str, nbytes: int) -> None:
    from hpckpt.core.codecs.mindspore_ckpt import piece_header

    path.write_bytes(piece_header(b"t", (nbytes,) if tensor_type == "str" else (2,), tensor_type.encode(), nbytes)
                     + bytes(nbytes))


def test_mindspore_ckpt_types_are_those_load_checkpoint_reads(tmp_path):
    import mindspore as ms

    for d in dtypes.all_dtypes():
        # the table's spelling, else MindSpore's own name of the dtype where it has one
        spellings = {d.mindspore, d.ms_spelling, str(getattr(ms, d.name)) if hasattr(ms, d.name) else None} - {None}
        loads = False
        for i, spelling in enumerate(sorted(spellings)):
            path = tmp_path / f"{d.name}-{i}.ckpt"
            _ckpt(path, spelling, 2 * d.itemsize)
            try:
                loads |= ms.load_checkpoint(str(path))["t"].shape == (2,)
            except Exception:  # noqa: BLE001 - MindSpore's own refusal
                pass
        assert loads == (dtypes.unsupported_reason(d, "mindspore-ckpt") is None), (d, spellings)


def test_unsupported_reason_covers_every_format_and_refuses_unknown_names():
    for d in dtypes.all_dtypes():
        for fmt in dtypes.FORMAT_NAMES:
            reason = dtypes.unsupported_reason(d, fmt)
            assert reason is None or isinstance(reason, str) and reason
    assert dtypes.unsupported_reason(dtypes.dtype("complex128"), "safetensors")
    assert dtypes.unsupported_reason(dtypes.dtype("complex128"), "torch-save") is None
    assert dtypes.unsupported_reason(dtypes.dtype("complex64"), "mindspore-ckpt")
    assert dtypes.unsupported_reason(dtypes.dtype("float8_e8m0fnu"), "hyperparallel") is None
    assert dtypes.unsupported_reason(dtypes.from_safetensors("F6_E2M3"), "torch-save")
    with pytest.raises(ValueError, match="unknown format"):
        dtypes.unsupported_reason(dtypes.dtype("float32"), "pt")


# --- copies, bit for bit ------------------------------------------------------------------------


def _read_back(to: str, out: Path, names: list[str]) -> dict[str, bytes]:
    """Each tensor's bytes as the format's own consumer loads them."""
    if to == "pt":
        return {k: _bytes(v) for k, v in torch.load(out, weights_only=True).items()}
    if to == "safetensors":
        return {k: _bytes(v) for k, v in load_file(out).items()}
    if to == "hf":
        return {k: _bytes(v) for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    if to == "torch-dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        meta = dcp.FileSystemReader(str(out)).read_metadata().state_dict_metadata
        state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
                 if isinstance(m, TensorStorageMetadata)}
        dcp.load(state, checkpoint_id=out, no_dist=True)
        return {k: _bytes(v) for k, v in state.items()}
    if to == "ms":
        import mindspore as ms

        loaded = ms.load_checkpoint(str(out))
        return {k: (v.view(ms.uint16) if v.dtype == ms.bfloat16 else v).asnumpy().tobytes() for k, v in loaded.items()}
    assert to == "hp"  # back through hpckpt into a torch.save file, read by torch
    result = _cli("convert", out, "-o", out.parent / "hp_back.pt")
    assert result.exit_code == 0, result.output
    return _read_back("pt", out.parent / "hp_back.pt", names)


def _convert_all(src: Path, tmp: Path, source: dict[str, torch.Tensor], extra: tuple[str, ...] = ()) -> None:
    """Convert `src` into every target (only what it can hold), compare bytes; refusals exit 15."""
    for to, fmt in TARGETS.items():
        names = [k for k in source if dtypes.unsupported_reason(dtypes.dtype(k), fmt) is None]
        out = tmp / to / OUT[to]
        out.parent.mkdir()
        result = _cli("convert", src, "-o", out, "--to", to, *extra, *sum((["-i", n] for n in names), []))
        assert result.exit_code == 0, (to, result.output)
        got = _read_back(to, out, names)
        assert set(got) == set(names), to
        for name in names:
            assert got[name] == _bytes(source[name]), (to, name)
        refused = [k for k in source if k not in names and k.startswith(("complex", "float8", "bits"))][:2]
        for name in refused:
            result = _cli("convert", src, "-o", tmp / to / f"x-{name}-{OUT[to]}", "--to", to, "-i", name)
            _assert_refused(result, name)


def test_torch_save_of_every_dtype_converts_bit_exactly(tmp_path):
    source = {d.name: _tensor(d, seed=i) for i, d in enumerate(COPIED)}
    torch.save(source, tmp_path / "src.pt")
    _convert_all(tmp_path / "src.pt", tmp_path, source)


def test_torch_dcp_of_every_dtype_converts_bit_exactly(tmp_path):
    import torch.distributed.checkpoint as dcp

    source = {d.name: _tensor(d, seed=i) for i, d in enumerate(COPIED) if not d.name.startswith("bits")}
    dcp.save(source, checkpoint_id=tmp_path / "src", no_dist=True)
    _convert_all(tmp_path / "src", tmp_path, source)


def test_safetensors_of_every_code_converts_and_reshards_bit_exactly(tmp_path):
    tensors = {d.name: _tensor(d, shape=(4, 6), seed=i) for i, d in enumerate(COPIED) if d.safetensors}
    save_file(tensors, tmp_path / "lib.safetensors")
    f6 = {code: (code, [4, 8], bytes(range(24))) for code in ("F6_E2M3", "F6_E3M2")}  # no library writes F6
    _hand_file(tmp_path / "f6.safetensors", f6)
    for src in (tmp_path / "lib.safetensors", tmp_path / "f6.safetensors"):
        expected = _raw_safetensors(src)
        for to, extra in (("safetensors", ()), ("hf", ()), ("hp", ("--world-size", "2")),
                          ("hp", ("--mesh", "2", "--placements", "S1"))):
            out = tmp_path / f"{src.stem}-{to}-{len(extra)}"
            target = out / "o.safetensors" if to == "safetensors" else out
            result = _cli("convert", src, "-o", target, "--to", to, *extra, "--parents")
            if to == "hp" and src.stem == "f6":
                _assert_refused(result, "F6_E2M3")  # HyperParallel names torch dtypes; torch has no F6
                continue
            assert result.exit_code == 0, result.output
            back = tmp_path / f"{out.name}-back.safetensors"  # (not inside the source)
            assert _cli("convert", target, "-o", back).exit_code == 0
            assert _raw_safetensors(back) == expected, (src.stem, to, extra)
        if src.stem == "lib":
            for name, t in load_file(back).items():
                assert _bytes(t) == _bytes(tensors[name]), name


def test_mindspore_ckpt_source_converts_bit_exactly(tmp_path):
    import mindspore as ms

    kinds = [d for d in COPIED if d.mindspore and d.name != "bfloat16"]
    arrays = {d.name: _tensor(d, seed=i).numpy() for i, d in enumerate(kinds)}
    ms.save_checkpoint([{"name": k, "data": ms.Tensor(v)} for k, v in arrays.items()], str(tmp_path / "a.ckpt"))
    for to in ("pt", "safetensors"):
        out = tmp_path / OUT[to]
        assert _cli("convert", tmp_path / "a.ckpt", "-o", out).exit_code == 0
        got = _read_back(to, out, list(arrays))
        assert got == {k: v.tobytes() for k, v in arrays.items()}, to


# --- refusals -----------------------------------------------------------------------------------


def test_complex128_to_safetensors_is_refused_naming_tensor_and_dtype(tmp_path):
    torch.save({"w": torch.zeros(2, dtype=torch.complex128)}, tmp_path / "a.pt")
    _assert_refused(_cli("convert", tmp_path / "a.pt", "-o", tmp_path / "a.safetensors"), "'w'", "complex128")
    assert not (tmp_path / "a.safetensors").exists()


@pytest.mark.parametrize("source", ["torch-save", "torch-dcp"])
def test_quantized_tensors_are_dtype_not_supported_not_unsafe(tmp_path, source):
    import torch.distributed.checkpoint as dcp

    state = {"q": torch.quantize_per_tensor(torch.arange(4.0), 0.5, 1, torch.qint8), "w": torch.ones(2),
             "qc": torch.quantize_per_channel(torch.ones(2, 3), torch.tensor([0.5, 0.25]), torch.tensor([0, 1]),
                                              0, torch.qint8)}
    if source == "torch-save":
        state["q4"] = torch.quantize_per_tensor(torch.arange(4.0), 1.0, 0, torch.quint4x2)  # 2 values a byte
        torch.save(state, tmp_path / "src")
    else:
        dcp.save(state, checkpoint_id=tmp_path / "src", no_dist=True)
    result = _cli("inspect", tmp_path / "src")
    assert result.exit_code == 0 and "qint8" in result.output, result.output
    result = _cli("verify", tmp_path / "src")
    assert result.exit_code == 15, result.output
    assert "[dtype-not-supported] q: dtype torch.qint8 not supported" in result.output
    assert result.output.count("[dtype-not-supported]") == len(state) - 1, result.output  # nothing else wrong
    for out in ("o.safetensors", "o.pt", "o.ckpt"):
        _assert_refused(_cli("convert", tmp_path / "src", "-o", tmp_path / out, "-i", "q"), "qint8")
    result = _cli("convert", tmp_path / "src", "-o", tmp_path / "w.safetensors", "-i", "w")
    assert result.exit_code == 0, result.output
    assert _bytes(load_file(tmp_path / "w.safetensors")["w"]) == _bytes(torch.ones(2))


def test_a_known_dtype_global_is_a_dtype_and_an_unknown_one_stays_unsafe():
    def pickled(name: str) -> bytes:
        return b"\x80\x02ctorch\n" + name.encode() + b"\nq\x00."

    assert unpickle.loads(pickled("float8_e8m0fnu"), what="t") is dtypes.dtype("float8_e8m0fnu")
    assert unpickle.loads(pickled("quint4x2"), what="t").refusal
    with pytest.raises(UnsafePickleError):
        unpickle.loads(pickled("float7"), what="t")
    with pytest.raises(UnsafePickleError):
        unpickle.loads(pickle.dumps(print), what="t")


@pytest.mark.parametrize("code", ["X9", "C128", "F8_E4M3FN"])
def test_verify_and_inspect_reject_a_code_safetensors_does_not_define(tmp_path, code):
    path = tmp_path / "bad.safetensors"
    _hand_file(path, {"ok": ("F32", [2], bytes(8)), "weird": (code, [2], bytes(32))})
    result = _cli("verify", path)
    assert result.exit_code == 9, result.output
    assert "weird" in result.output and code in result.output and "bad.safetensors" in result.output
    _assert_refused(_cli("inspect", path), "weird", code, code=9)


def test_f4_whose_rows_split_a_byte_is_refused_and_a_bad_byte_count_is_corrupt(tmp_path):
    _hand_file(tmp_path / "odd.safetensors", {"w": ("F4", [2, 3], bytes(3))})  # valid file, 1.5-byte rows
    with safe_open(tmp_path / "odd.safetensors", "np"):
        pass  # the library accepts the file
    for command in ("inspect", "verify"):
        _assert_refused(_cli(command, tmp_path / "odd.safetensors"), "'w'", "F4")
    _assert_refused(_cli("convert", tmp_path / "odd.safetensors", "-o", tmp_path / "o.pt"), "F4")
    _hand_file(tmp_path / "half.safetensors", {"w": ("F4", [3], bytes(2))})  # 12 bits
    _assert_refused(_cli("inspect", tmp_path / "half.safetensors"), "'w'", "12 bits", code=9)


def test_0d_float4_pair_has_no_safetensors_shape(tmp_path):
    torch.save({"s": torch.tensor(7, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}, tmp_path / "s.pt")
    _assert_refused(_cli("convert", tmp_path / "s.pt", "-o", tmp_path / "s.safetensors"), "'s'", "float4_e2m1fn_x2")
    with pytest.raises(UnsupportedDTypeError):
        safetensors_io.encode_header([("s", dtypes.dtype("float4_e2m1fn_x2"), ())])
    out = tmp_path / "s2.pt"  # torch.save holds it
    assert _cli("convert", tmp_path / "s.pt", "-o", out).exit_code == 0
    assert _bytes(torch.load(out, weights_only=True)["s"]) == b"\x07"


def test_numpy_storage_of_every_dtype_has_its_item_size():
    for d in dtypes.all_dtypes():
        assert np.dtype(d.numpy_storage).itemsize == d.itemsize, d
