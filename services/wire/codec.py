"""The ONE tensor codec: arrays <-> ``kakeya.v1.Tensor``.

Every tensor that crosses a process goes through :func:`to_proto` and :func:`from_proto`; nothing else reads or writes
``Tensor.data``. Wire format (``protos/kakeya/v1/tensor.proto``): ``dtype`` + ``shape`` + ``data``, the elements raw,
little-endian, C order, exactly ``prod(shape) * itemsize`` bytes.

Backends: numpy always; ``mx.array`` and ``torch.Tensor`` are recognised without importing mlx or torch (an input can
only be one of theirs if its module is already loaded), and are imported only when ``like=`` asks for them; their
conversions are the backends' own (``kakeya.backends.{torch,mlx}.arrays``).

Copies: encoding makes one host copy into ``bytes`` (plus a device-to-host copy for a GPU torch tensor); protobuf then
copies that into the message. Decoding reads ``Tensor.data`` once (protobuf hands out a fresh ``bytes`` each time) and
views it with ``np.frombuffer``; mlx copies that view into its own memory, torch copies it once, straight onto
``device`` (default CPU).

bfloat16 has no numpy dtype: numpy sees it as its ``uint16`` bit patterns (the upper half of a float32's); mlx and
torch get real bfloat16 arrays. Errors: a malformed Tensor raises ``ValueError`` naming the problem (servers map it to
``INVALID_ARGUMENT``); an input of an unsupported type raises ``TypeError``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from kakeya.wire.kakeya.v1.tensor_pb2 import DType, Tensor

LIKES = ("numpy", "mlx", "torch")


@dataclass(frozen=True)
class _Spec:
    code: int  # DType value
    name: str  # "float32", ... (the torch dtype name; mlx calls bool "bool_")
    wire: np.dtype  # numpy dtype of the wire bytes (bfloat16: its uint16 bits)

    @property
    def itemsize(self) -> int:
        return self.wire.itemsize


_SPECS = (
    _Spec(DType.DTYPE_FLOAT32, "float32", np.dtype("<f4")),
    _Spec(DType.DTYPE_FLOAT16, "float16", np.dtype("<f2")),
    _Spec(DType.DTYPE_BFLOAT16, "bfloat16", np.dtype("<u2")),
    _Spec(DType.DTYPE_INT32, "int32", np.dtype("<i4")),
    _Spec(DType.DTYPE_INT64, "int64", np.dtype("<i8")),
    _Spec(DType.DTYPE_UINT8, "uint8", np.dtype("u1")),
    _Spec(DType.DTYPE_INT8, "int8", np.dtype("i1")),
    _Spec(DType.DTYPE_BOOL, "bool", np.dtype("?")),
)
_BY_CODE = {s.code: s for s in _SPECS}
_BY_NAME = {s.name: s for s in _SPECS}
_BF16 = _BY_NAME["bfloat16"]
_SUPPORTED = ", ".join(s.name for s in _SPECS)


def dtype_name(code: int) -> str:
    """``DType`` value -> "float32", ... (``ValueError`` for unknown or unspecified)."""
    return _spec_of_code(code).name


def _spec_of_code(code: int) -> _Spec:
    spec = _BY_CODE.get(code)
    if spec is not None:
        return spec
    if code == DType.DTYPE_UNSPECIFIED:
        raise ValueError("tensor dtype is DTYPE_UNSPECIFIED (unset)")
    raise ValueError(f"tensor dtype {code} is unknown; supported: {_SUPPORTED}")


def _spec_of_arg(dtype: Any) -> _Spec:
    """A ``DType`` value or a name ("bfloat16", "DTYPE_BFLOAT16")."""
    if isinstance(dtype, str):
        spec = _BY_NAME.get(dtype.lower().removeprefix("dtype_"))
        if spec is None:
            raise ValueError(f"dtype {dtype!r} is not supported; supported: {_SUPPORTED}")
        return spec
    return _spec_of_code(int(dtype))


# ---------------------------------------------------------------- encoding


def _backend(name: str):
    """The backend's array adapter (``kakeya.backends.<name>.arrays``), imported when first needed."""
    if name == "torch":
        from kakeya.backends.torch import arrays
    else:
        from kakeya.backends.mlx import arrays
    return arrays


def _numpy_of(array: Any, want: _Spec | None) -> tuple[np.ndarray, _Spec]:
    """Host numpy view of ``array`` (no copy where possible) and its wire spec."""
    # a torch tensor or an mx.array can only reach us if its package is already imported
    for module, backend in (("torch", "torch"), ("mlx.core", "mlx")):
        if sys.modules.get(module) is not None and _backend(backend).owns(array):
            arr, name = _backend(backend).to_host(array)
            spec = _BY_NAME.get(name)
            if spec is None:
                raise ValueError(f"{backend} dtype {name} is not supported; supported: {_SUPPORTED}")
            return (arr.view(_BF16.wire) if spec is _BF16 else arr), spec

    if isinstance(array, (np.ndarray, np.generic)):
        arr = np.asarray(array)
        name = arr.dtype.name
        if name == "bfloat16":  # ml_dtypes' numpy bfloat16, if someone uses it
            return arr.view(np.uint16), _BF16
        if want is _BF16 and arr.dtype.kind in "ui" and arr.dtype.itemsize == 2:  # bfloat16 bit patterns
            return arr.view(arr.dtype.str.replace("i", "u")), _BF16
        spec = _BY_NAME.get(name)
        if spec is None or arr.dtype.kind != spec.wire.kind:
            raise ValueError(f"numpy dtype {arr.dtype} is not supported; supported: {_SUPPORTED}")
        return arr, spec

    raise TypeError(f"to_proto takes a numpy array, mx.array or torch.Tensor, not {type(array).__name__}")


def to_proto(array: Any, dtype: Any = None) -> Tensor:
    """Encode a numpy array, ``mx.array`` or ``torch.Tensor`` as a ``Tensor``. ``dtype`` (optional, a ``DType`` value
    or a name) must match the array's own dtype, with one exception: a ``uint16``/``int16`` numpy array with
    ``dtype="bfloat16"`` is sent as the bfloat16 values whose bit patterns it holds."""
    want = None if dtype is None else _spec_of_arg(dtype)
    arr, spec = _numpy_of(array, want)
    if want is not None and want is not spec:
        raise ValueError(f"cannot send a {spec.name} array as {want.name}: convert it first")
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and sys.byteorder == "big"):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    # tobytes() writes C order whatever the strides: the one host copy.
    return Tensor(dtype=spec.code, shape=arr.shape, data=arr.tobytes(order="C"))


# ---------------------------------------------------------------- decoding


def validate(tensor: Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """Check a ``Tensor``; return ``(dtype name, shape, data)`` or raise ``ValueError``."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"expected a kakeya.v1.Tensor, not {type(tensor).__name__}")
    spec = _spec_of_code(tensor.dtype)
    shape = tuple(int(d) for d in tensor.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"tensor shape {list(shape)} has a negative dimension")
    data = tensor.data  # protobuf builds a new bytes object per access: read it once
    count = math.prod(shape)
    want = count * spec.itemsize
    if len(data) != want:
        raise ValueError(
            f"tensor data has {len(data)} bytes but {spec.name} shape {list(shape)} needs "
            f"{want} ({count} elements x {spec.itemsize} bytes)"
        )
    return spec.name, shape, data


def from_proto(tensor: Tensor, like: str = "numpy", *, device: Any = None) -> Any:
    """Decode a ``Tensor`` into the array type ``like`` names.

    - ``"numpy"``: a READ-ONLY view of the message's bytes (``.copy()`` it to write); bfloat16 arrives as ``uint16``.
    - ``"mlx"``: an ``mx.array`` of the same dtype.
    - ``"torch"``: a ``torch.Tensor`` of the same dtype, on ``device`` (default CPU), owning writable memory.
    """
    if like not in LIKES:
        raise ValueError(f"like must be one of {LIKES}, got {like!r}")
    if device is not None and like != "torch":
        raise ValueError(f"device= applies to like='torch' only (got like={like!r})")
    name, shape, data = validate(tensor)
    spec = _BY_NAME[name]
    arr = np.frombuffer(data, dtype=spec.wire).reshape(shape)
    if sys.byteorder == "big" and spec.itemsize > 1:  # pragma: no cover - no such host in use
        arr = arr.astype(spec.wire.newbyteorder("="))
    return arr if like == "numpy" else _backend(like).from_host(arr, spec is _BF16, device)
