"""The tensor codec: round-trips for every dtype and backend, clear errors for bad tensors."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from kakeya.wire.codec import DType, Tensor, dtype_name, from_proto, to_proto, validate


# bfloat16's bit patterns as numpy holds them (uint16), converted by hand: what the backends' arrays must match
def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (``uint16``) -> float32 values (exact)."""
    bits = np.asarray(bits)
    if bits.dtype.itemsize != 2 or bits.dtype.kind not in "ui":
        raise ValueError(f"bfloat16 bits must be a 16-bit integer array, got {bits.dtype}")
    return (bits.astype(np.uint16).astype(np.uint32) << 16).view(np.float32)


def float32_to_bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 values -> bfloat16 bit patterns (``uint16``), round-to-nearest-even; NaN stays NaN."""
    v = np.asarray(values, dtype=np.float32)
    u = v.view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(v), np.uint16(0x7FC0) | (u >> 16).astype(np.uint16), rounded)


NAMES = ["float32", "float16", "bfloat16", "int32", "int64", "uint8", "int8", "bool"]
SHAPES = [(), (0,), (7,), (2, 3, 5), (4, 0, 2)]
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8, "uint8": 1, "int8": 1, "bool": 1}


def _values(name: str, shape, seed: int = 0) -> np.ndarray:
    """float32 / int64 / bool reference values, exactly representable in ``name``."""
    rng = np.random.default_rng(seed)
    if name == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if name in ("int32", "int64"):
        big = 2**31 - 1 if name == "int32" else 2**62
        return rng.integers(-big, big, size=shape, dtype=np.int64)
    if name in ("uint8", "int8"):
        lo, hi = (0, 255) if name == "uint8" else (-128, 127)
        return rng.integers(lo, hi + 1, size=shape, dtype=np.int64)
    vals = rng.standard_normal(shape).astype(np.float32) * 8
    return (
        bfloat16_to_float32(float32_to_bfloat16(vals)) if name == "bfloat16" else vals.astype(name).astype(np.float32)
    )


def _numpy(ref: np.ndarray, name: str) -> np.ndarray:
    return float32_to_bfloat16(ref) if name == "bfloat16" else ref.astype(name)


def _mlx(ref: np.ndarray, name: str) -> mx.array:
    return mx.array(ref).astype(getattr(mx, "bool_" if name == "bool" else name))


def _torch(ref: np.ndarray, name: str) -> torch.Tensor:
    return torch.from_numpy(np.array(ref, order="C")).to(getattr(torch, name))


def _as_ref(x) -> np.ndarray:
    """Any decoded array -> float32 / int64 / bool numpy, for comparison with ``_values``."""
    if isinstance(x, mx.array):
        if x.dtype in (mx.float16, mx.bfloat16):
            x = x.astype(mx.float32)
        return np.asarray(x)
    if isinstance(x, torch.Tensor):
        if x.dtype in (torch.float16, torch.bfloat16):
            x = x.float()
        return x.numpy()
    return x


def _same(decoded, ref, name, shape):
    assert tuple(decoded.shape) == tuple(shape)
    got = _as_ref(decoded)
    if name == "bfloat16" and isinstance(decoded, np.ndarray):
        got = bfloat16_to_float32(got)
    np.testing.assert_array_equal(got.astype(ref.dtype), ref)


BUILD = {"numpy": _numpy, "mlx": _mlx, "torch": _torch}


def _encode(src: str, ref: np.ndarray, name: str) -> Tensor:
    """numpy has no bfloat16: its bits go with an explicit dtype."""
    return to_proto(BUILD[src](ref, name), dtype=name if src == "numpy" and name == "bfloat16" else None)


TORCH_DTYPE = {n: getattr(torch, n) for n in NAMES}
MLX_DTYPE = {n: getattr(mx, "bool_" if n == "bool" else n) for n in NAMES}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("src", ["numpy", "mlx", "torch"])
@pytest.mark.parametrize("dst", ["numpy", "mlx", "torch"])
def test_round_trip_every_dtype_and_backend(name, src, dst):
    for i, shape in enumerate(SHAPES):
        ref = _values(name, shape, seed=i)
        msg = _encode(src, ref, name)
        assert dtype_name(msg.dtype) == name and list(msg.shape) == list(shape)
        assert len(msg.data) == int(np.prod(shape)) * ITEMSIZE[name]
        msg = Tensor.FromString(msg.SerializeToString())  # through the wire format too
        out = from_proto(msg, like=dst)
        if dst == "mlx":
            assert out.dtype == MLX_DTYPE[name]
        elif dst == "torch":
            assert out.dtype == TORCH_DTYPE[name]
        else:
            assert out.dtype == (np.uint16 if name == "bfloat16" else np.dtype(name))
        _same(out, ref, name, shape)


@pytest.mark.parametrize("name", NAMES)
def test_all_backends_put_the_same_bytes_on_the_wire(name):
    ref = _values(name, (3, 4), seed=9)
    wire = {src: _encode(src, ref, name).SerializeToString() for src in BUILD}
    assert wire["numpy"] == wire["mlx"] == wire["torch"]


def test_wire_bytes_are_little_endian_row_major():
    msg = to_proto(np.array([[1, 2], [3, 4]], dtype=np.int32))
    assert msg.dtype == DType.DTYPE_INT32 and list(msg.shape) == [2, 2]
    assert msg.data == b"".join(v.to_bytes(4, "little") for v in (1, 2, 3, 4))
    assert to_proto(np.array([1.0], dtype=">f4")).data == np.float32(1.0).tobytes()  # big-endian input is swapped
    bf = to_proto(torch.tensor([1.0, -2.0], dtype=torch.bfloat16))
    assert bf.dtype == DType.DTYPE_BFLOAT16 and bf.data == bytes([0x80, 0x3F, 0x00, 0xC0])


@pytest.mark.parametrize("src", ["numpy", "mlx", "torch"])
def test_non_contiguous_inputs(src):
    ref = np.arange(24, dtype=np.int64).reshape(4, 6)
    x = BUILD[src](ref, "int32")
    views = {"transposed": (x.T, ref.T), "strided": (x[:, ::2], ref[:, ::2]), "tail": (x[1:], ref[1:])}
    for what, (view, want) in views.items():
        out = from_proto(to_proto(view))
        np.testing.assert_array_equal(out, want, err_msg=what)


def test_numpy_decode_is_a_read_only_view_and_other_backends_own_their_memory():
    msg = to_proto(np.arange(6, dtype=np.float32))
    arr = from_proto(msg)
    assert not arr.flags.writeable
    t = from_proto(msg, like="torch")
    t += 1  # writable, and does not touch the message
    assert from_proto(msg)[0] == 0 and t[0].item() == 1


def test_torch_autograd_and_device_arguments():
    x = torch.ones(2, 3, requires_grad=True) * 2
    out = from_proto(to_proto(x), like="torch", device="cpu")
    assert out.device.type == "cpu" and not out.requires_grad and torch.equal(out, x.detach())
    with pytest.raises(ValueError, match="device= applies to like='torch' only"):
        from_proto(to_proto(np.zeros(2, np.float32)), like="mlx", device="cpu")


def test_mlx_lazy_arrays_are_evaluated():
    a = mx.arange(10, dtype=mx.float32) * 3  # not evaluated yet
    np.testing.assert_array_equal(from_proto(to_proto(a)), np.arange(10, dtype=np.float32) * 3)


def test_bfloat16_bits_from_numpy():
    vals = np.array([0.5, -3.0, 1e30, np.inf], dtype=np.float32)
    bits = float32_to_bfloat16(vals)
    for dtype in ("bfloat16", DType.DTYPE_BFLOAT16, "DTYPE_BFLOAT16"):
        msg = to_proto(bits, dtype=dtype)
        assert msg.dtype == DType.DTYPE_BFLOAT16
        assert torch.equal(from_proto(msg, like="torch"), torch.from_numpy(vals).to(torch.bfloat16))
    assert to_proto(bits.view(np.int16), dtype="bfloat16").data == msg.data
    with pytest.raises(ValueError, match="cannot send a float32 array as bfloat16"):
        to_proto(vals, dtype="bfloat16")
    assert to_proto(vals, dtype="float32").dtype == DType.DTYPE_FLOAT32


def test_float32_to_bfloat16_rounds_like_torch():
    x = (torch.randn(4096) * 10 ** torch.randint(-30, 30, (4096,)).float()).numpy()
    x = np.concatenate([x, np.array([np.nan, -np.inf, 3.4e38, -0.0], dtype=np.float32)])
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = float32_to_bfloat16(x)
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(got[finite], want[finite])
    assert np.isnan(bfloat16_to_float32(got[~finite])).all()


# ---------------------------------------------------------------- errors


def _bad(**kw) -> Tensor:
    base = dict(dtype=DType.DTYPE_FLOAT32, shape=[2, 3], data=bytes(24))
    base.update(kw)
    return Tensor(**base)


@pytest.mark.parametrize(
    "tensor, message",
    [
        (_bad(dtype=DType.DTYPE_UNSPECIFIED), "tensor dtype is DTYPE_UNSPECIFIED"),
        (_bad(dtype=99), "tensor dtype 99 is unknown; supported: float32, float16, bfloat16"),
        (
            _bad(data=bytes(23)),
            r"tensor data has 23 bytes but float32 shape \[2, 3\] needs 24 \(6 elements x 4 bytes\)",
        ),
        (_bad(data=b""), "tensor data has 0 bytes but float32 shape"),
        (_bad(dtype=DType.DTYPE_INT64), r"needs 48 \(6 elements x 8 bytes\)"),
        (_bad(shape=[]), r"shape \[\] needs 4 \(1 elements"),
        (_bad(shape=[2, -3]), r"tensor shape \[2, -3\] has a negative dimension"),
        (_bad(shape=[2**40, 2**40]), "tensor data has 24 bytes but float32 shape"),
    ],
)
@pytest.mark.parametrize("like", ["numpy", "mlx", "torch"])
def test_bad_tensors_raise_value_error_naming_the_problem(tensor, message, like):
    with pytest.raises(ValueError, match=message):
        from_proto(tensor, like=like)
    with pytest.raises(ValueError, match=message):
        validate(tensor)


def test_validate_returns_the_parts():
    name, shape, data = validate(_bad())
    assert (name, shape, data) == ("float32", (2, 3), bytes(24))


def test_unknown_like_and_unsupported_inputs():
    with pytest.raises(ValueError, match="like must be one of"):
        from_proto(_bad(), like="jax")
    with pytest.raises(ValueError, match="numpy dtype float64 is not supported"):
        to_proto(np.zeros(3))
    with pytest.raises(ValueError, match="numpy dtype uint16 is not supported"):
        to_proto(np.zeros(3, np.uint16))
    with pytest.raises(ValueError, match="torch dtype float64 is not supported"):
        to_proto(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="mlx dtype uint32 is not supported"):
        to_proto(mx.zeros(3, dtype=mx.uint32))
    with pytest.raises(ValueError, match="dtype 'complex64' is not supported"):
        to_proto(np.zeros(3, np.float32), dtype="complex64")
    with pytest.raises(TypeError, match="not list"):
        to_proto([1, 2, 3])
    with pytest.raises(TypeError, match="expected a kakeya.v1.Tensor"):
        from_proto(np.zeros(3, np.float32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", NAMES)
def test_torch_cuda_round_trip(name):
    ref = _values(name, (5, 7), seed=4)
    x = _torch(ref, name).cuda()
    out = from_proto(to_proto(x), like="torch", device="cuda")
    assert out.device.type == "cuda" and out.dtype == x.dtype and torch.equal(out, x)
