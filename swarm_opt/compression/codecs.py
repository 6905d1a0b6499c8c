"""Codecs for the tensors peers exchange: pass one as ``swarm_opt.Optimizer(compression=swarm_opt.Float16())``.

Each codec is a ``hivemind.compression.CompressionBase`` that hivemind's averager uses unchanged, with a stated
error bound that the conformance tests check (``CODECS`` lists them all):

=====================  ===============  =====================================================================
codec                  bytes per value  error of one value ``x`` after a round trip (``absmax`` over the group)
=====================  ===============  =====================================================================
``NoCompression()``    4 (fp32)         0
``Float16()``          2                ≤ 2⁻¹¹·|x| + 2⁻³⁹·absmax(tensor); never overflows (power-of-two scale)
``Int8Blockwise(b)``   1 + 4/b          ≤ absmax(block of b values) / 254
``Uniform8Bit()``      1                ≤ (max − min)(tensor) / 510
``TopK(fraction)``     8 per nonzero    0 on the wire (COO, or dense when smaller); the values a round does not
                       (≤ 4)            send stay in the peer's residual and go out in later rounds
=====================  ===============  =====================================================================

``TopK(fraction)`` sparsifies each peer's values before the wire, with error feedback
(``swarm_opt.compression.sparse``), and serves gradient averaging only.

``PowerSGD(rank)`` (``swarm_opt.compression.powersgd``) is not elementwise: it sends low-rank factors of each
gradient matrix with error feedback, through an averaging protocol of its own, and only with gradient averaging.

Every codec refuses NaN and infinite values with ``NonFiniteTensorError`` where it encodes them. A peer never gets
there with its own tensors (``TensorAverager.all_reduce`` sits a round out when they are not finite); inside an
all-reduce the refusal is the last line of defence against poison. Integer tensors are sent uncompressed.
Tensors are encoded in float32 and decoded into their original dtype (float16, bfloat16, float32 or float64).

How a codec reaches the other side (hivemind's wire plumbing)
-------------------------------------------------------------
hivemind never sends the codec object. A serialized tensor carries only a ``compression`` enum, one of the six
names of ``runtime.proto`` (NONE, MEANSTD_16BIT, FLOAT16, QUANTILE_8BIT, UNIFORM_8BIT, BLOCKWISE_8BIT); a receiver
decodes it with the codec that the process-global table ``hivemind.compression.serialization.
_BASE_COMPRESSION_TYPES`` holds for that name. A reducer of the butterfly all-reduce also *re-encodes* the
difference it sends back (``allreduce.py``: ``serialize_torch_tensor(averaged - part, part_compression)``) with
that table's codec, not with anybody's codec object. A new enum value cannot be used (``CompressionType.Name``
raises on it). Therefore:

* ``NoCompression`` keeps hivemind's NONE slot and payload (plus the NaN check).
* The lossy codecs share one slot, UNIFORM_8BIT, whose own hivemind codec cannot decode its payload under numpy 2
  (``int()`` of a one-element array raises; see docs/hivemind.md). Importing swarm_opt installs ``_SwarmSlot``
  there. Our payloads start with a 5-byte header (magic + codec tag) and carry their parameters (the block size),
  so any peer decodes any of our codecs; a payload without the header goes to hivemind's original decoder.
* The slot re-encodes a reducer's differences with the codec of the averager in the same process: a codec claims
  the slot when hivemind asks it for its compression ratio, which hivemind does in the averager process as it
  splits the tensors at the start of every round (``TensorPartContainer.__init__``), before it encodes or decodes
  any part. A process that claimed nothing sends differences back uncompressed (exact).
Peers running plain hivemind cannot decode our payloads; they never meet ours (prefixes differ).
"""

from __future__ import annotations

import math
import struct
from abc import abstractmethod
from typing import Any, ClassVar, Dict, Optional, Sequence, Tuple, Type

import numpy as np
import torch
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.compression import NoCompression as _HivemindNoCompression
from hivemind.compression import serialization as _hivemind_serialization
from hivemind.proto import runtime_pb2

from swarm_opt.aggregation import Mean
from swarm_opt.compression.base import Compression
from swarm_opt.compression.sparse import SparseFeedback
from swarm_opt.errors import ConfigError, ConfigTypeError, NonFiniteTensorError

__all__ = ["Codec", "NoCompression", "Float16", "Int8Blockwise", "Uniform8Bit", "TopK", "CODECS"]

_MAGIC = b"SWO\x01"  # hivemind's UNIFORM_8BIT payload starts with int64 256 = b"\x00\x01...", never with this
_HEADER = len(_MAGIC) + 1  # magic + one byte naming the codec
_SLOT_NAME = "UNIFORM_8BIT"
_WIRE_DTYPES: Dict[str, torch.dtype] = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64,
}
_EXACT = _HivemindNoCompression()
_FP32_MAX = torch.finfo(torch.float32).max
_BLOCK_SIZES = range(8, 2**24 + 1)  # Int8Blockwise; the upper limit also bounds what a hostile payload can allocate
_MAX_SPARSE_NUMEL = 2**24  # the largest part TopK sends as COO: a payload of a few bytes may not allocate more


class Codec(CompressionBase, Compression):
    """A swarm_opt codec: a hivemind ``CompressionBase`` with a documented error bound and wire size, and the
    capabilities of every ``Compression`` (``swarm_opt.compression.base``).

    Subclasses state ``nominal_error``: no value moves by more than ``nominal_error`` times the largest magnitude
    of the group it is scaled with (tensor or block); ``error_bound`` gives the exact per-value bound.
    """

    nominal_error: ClassVar[float]

    @property
    @abstractmethod
    def bytes_per_value(self) -> float:
        """Payload bytes per float32 value of a large tensor (headers and protobuf framing excluded)."""

    @abstractmethod
    def error_bound(self, tensor: torch.Tensor) -> torch.Tensor:
        """The largest round-trip error this codec guarantees for each value of ``tensor`` (float32 arithmetic
        aside: allow a few float32 ulps of ``absmax`` on top)."""

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        dtype = info.descriptor.dtype
        if not dtype.is_floating_point:
            return 1.0
        return self.bytes_per_value / torch.finfo(dtype).bits * 8

    def __repr__(self) -> str:
        return f"swarm_opt.{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:  # codecs are values: equal type and parameters (their repr)
        return type(self) is type(other) and repr(self) == repr(other)

    def __hash__(self) -> int:
        return hash(repr(self))



def _check_finite(tensor: torch.Tensor, codec: Codec, summary: Optional[torch.Tensor] = None) -> None:
    """Refuse to send NaN/inf: hivemind would average them into every groupmate's result.

    ``summary`` is a reduction the codec computes anyway (max |x|, per-block absmax, min and max) and that is
    non-finite whenever ``tensor`` holds NaN/inf, so the check usually costs nothing; without one we test the sum,
    which can also overflow, and only then scan every value (a full scan costs as much as encoding in fp16)."""
    if not tensor.is_floating_point():
        return
    if summary is None:
        summary = tensor.sum()
    if bool(torch.isfinite(summary).all()) or bool(torch.isfinite(tensor).all()):
        return
    nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
    raise NonFiniteTensorError(
        f"{codec!r} was given a tensor of shape {tuple(tensor.shape)} with {nan} NaN and {inf} infinite values "
        f"(or values beyond the float32 range); they cannot be sent to peers. Find where training diverges: "
        f"lower the learning rate, clip gradients, or skip steps with non-finite gradients"
    )


class NoCompression(_HivemindNoCompression, Codec):
    """Send tensors as they are (hivemind's NONE encoding), refusing NaN/inf like every other codec."""

    nominal_error = 0.0

    @property
    def lane_dtype(self) -> Optional[torch.dtype]:
        return torch.float32

    @property
    def bytes_per_value(self) -> float:
        return 4.0

    def error_bound(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(tensor, dtype=torch.float32)

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        _check_finite(tensor, self)
        return super().compress(tensor, info, allow_inplace)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 1.0


class _SlotCodec(Codec):
    """A lossy codec that travels in the shared UNIFORM_8BIT slot with a self-describing payload."""

    compression_type = runtime_pb2.CompressionType.Value(_SLOT_NAME)
    tag: ClassVar[int]

    @abstractmethod
    def _statistics(self, values: torch.Tensor) -> torch.Tensor:
        """What the encoding scales by (max |x|, per-block absmax...): non-finite iff ``values`` holds NaN/inf."""

    @abstractmethod
    def _encode(self, values: torch.Tensor, statistics: torch.Tensor) -> bytes:
        """Encode a flat, finite float32 tensor into the bytes that follow the header."""

    @classmethod
    @abstractmethod
    def _decode(cls, body: memoryview, numel: int) -> torch.Tensor:
        """Decode ``_encode``'s bytes back into a flat float32 tensor of ``numel`` values."""

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        tensor = tensor.detach()
        if not tensor.is_floating_point():
            return _EXACT.compress(tensor, info, allow_inplace)
        values = tensor.to(device="cpu", dtype=torch.float32).reshape(-1)
        statistics = self._statistics(values)
        _check_finite(values, self, statistics)
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=_MAGIC + bytes([self.tag]) + self._encode(values, statistics),
            size=tensor.shape,
            dtype=str(tensor.dtype).replace("torch.", ""),
            requires_grad=tensor.requires_grad,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return _extract_any(serialized_tensor)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        _slot().encoder = self  # hivemind calls this in the averager process before each round; see module doc
        return super().estimate_compression_ratio(info)


def _extract_any(serialized: runtime_pb2.Tensor) -> torch.Tensor:
    """Decode any _SlotCodec payload; malformed input (a buggy or hostile peer) raises ValueError."""
    buffer = memoryview(serialized.buffer)
    if bytes(buffer[: len(_MAGIC)]) != _MAGIC or len(buffer) < _HEADER:
        raise ValueError("not a swarm_opt codec payload")
    codec_type = _CODEC_BY_TAG.get(buffer[len(_MAGIC)])
    dtype = _WIRE_DTYPES.get(serialized.dtype)
    if codec_type is None or dtype is None:
        raise ValueError(f"unknown codec tag {buffer[len(_MAGIC)]} or dtype {serialized.dtype!r}; are all peers "
                         f"running the same swarm_opt version?")
    shape = torch.Size(serialized.size)
    try:
        values = codec_type._decode(buffer[_HEADER:], shape.numel())
    except struct.error as e:  # a header field cut short
        raise ValueError(f"truncated {codec_type.__name__} payload: {e}") from e
    return values.to(dtype).reshape(shape).requires_grad_(serialized.requires_grad)


def _read(body: memoryview, offset: int, dtype: type, count: int) -> Tuple[np.ndarray, int]:
    """``count`` values of ``dtype`` at ``offset``, and the offset after them; raises on a short buffer."""
    array = np.frombuffer(body, dtype=dtype, count=count, offset=offset)
    return array, offset + array.nbytes


def _expect_end(body: memoryview, offset: int) -> None:
    if offset != len(body):
        raise ValueError(f"codec payload has {len(body) - offset} unexpected trailing bytes")


class Float16(_SlotCodec):
    """IEEE half precision after a per-tensor power-of-two scale.

    Why a scale: a plain cast (hivemind's ``Float16Compression``) clamps values beyond ±65504, turning large
    gradients into wrong finite numbers without a word, and flushes values below 6e-5 into subnormals or zero.
    We divide by 2^k chosen so that the largest magnitude lands in [2¹⁴, 2¹⁵): nothing can overflow, every value
    above absmax·2⁻²⁹ keeps fp16's full 11-bit precision, and a power of two scales without rounding.
    Error ≤ 2⁻¹¹·|x| + 2⁻³⁹·absmax. Costs 2 bytes per value plus a 2-byte exponent per tensor part.
    """

    nominal_error = 2.0**-11
    tag = 1

    @property
    def lane_dtype(self) -> Optional[torch.dtype]:
        return torch.float16

    @property
    def bytes_per_value(self) -> float:
        return 2.0

    def error_bound(self, tensor: torch.Tensor) -> torch.Tensor:
        values = tensor.detach().float()
        absmax = values.abs().max() if values.numel() else torch.tensor(0.0)
        return values.abs() * self.nominal_error + absmax * 2.0**-39

    def _statistics(self, values: torch.Tensor) -> torch.Tensor:
        return values.abs().max() if values.numel() else torch.tensor(0.0)

    def _encode(self, values: torch.Tensor, statistics: torch.Tensor) -> bytes:
        absmax = float(statistics)
        # absmax in [2^(e-1), 2^e) → absmax / 2^(e-15) in [2^14, 2^15); clamped so that 2^-exponent is a normal fp32
        exponent = 0 if absmax == 0.0 else min(max(math.frexp(absmax)[1] - 15, -126), 113)
        half = (values * 2.0**-exponent).to(torch.float16)
        return struct.pack("<h", exponent) + half.numpy().tobytes()

    @classmethod
    def _decode(cls, body: memoryview, numel: int) -> torch.Tensor:
        (exponent,) = struct.unpack_from("<h", body)
        half, end = _read(body, 2, np.float16, numel)
        _expect_end(body, end)
        return torch.from_numpy(half.astype(np.float32)).mul_(2.0**exponent)


class Int8Blockwise(_SlotCodec):
    """8-bit integers with one float32 absmax per block of ``block_size`` values: ``q = round(127·x/absmax)``.

    One outlier only coarsens its own block, so the rest of a gradient keeps its precision (a per-tensor scale
    would zero every value below absmax/254). Error ≤ absmax(block)/254; costs 1 + 4/block_size bytes per value.
    Smaller blocks are more precise and spend more on scales. Blocks restart at every part of a tensor the all-reduce
    sends (up to 2 MiB; see ``TensorAverager``).

    :param block_size: values per scale, 8 to 2**24; default 256 (1.6 % of the bytes go to scales).
    """

    nominal_error = 1.0 / 254
    tag = 2

    def __init__(self, block_size: int = 256) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int):
            raise ConfigTypeError(f"Int8Blockwise(block_size=...) must be an int, e.g. 256; got {block_size!r}")
        if block_size not in _BLOCK_SIZES:
            raise ConfigError(
                f"Int8Blockwise(block_size={block_size}) is out of range: use {_BLOCK_SIZES.start} to "
                f"{_BLOCK_SIZES.stop - 1} (e.g. 256); below 8 the scales cost more bytes than Float16() sends in total"
            )
        self.block_size = block_size

    def __repr__(self) -> str:
        return f"swarm_opt.Int8Blockwise(block_size={self.block_size})"

    @property
    def bytes_per_value(self) -> float:
        return 1.0 + 4.0 / self.block_size

    def error_bound(self, tensor: torch.Tensor) -> torch.Tensor:
        blocks, numel = _blocks(tensor.detach().float().reshape(-1), self.block_size)
        bound = blocks.abs().amax(dim=1, keepdim=True).expand_as(blocks) / 254
        return bound.reshape(-1)[:numel].reshape(tensor.shape)

    def _statistics(self, values: torch.Tensor) -> torch.Tensor:
        return _blocks(values, self.block_size)[0].abs().amax(dim=1, keepdim=True)

    def _encode(self, values: torch.Tensor, absmax: torch.Tensor) -> bytes:
        blocks, numel = _blocks(values, self.block_size)
        # dividing by the smallest subnormal leaves an all-zero block at zero instead of 0/0
        scaled = blocks / absmax.clamp_min(torch.finfo(torch.float32).smallest_normal * 2.0**-23)
        quantized = scaled.mul_(127).round_().clamp_(-127, 127).to(torch.int8).reshape(-1)[:numel]
        return struct.pack("<I", self.block_size) + absmax.numpy().tobytes() + quantized.numpy().tobytes()

    @classmethod
    def _decode(cls, body: memoryview, numel: int) -> torch.Tensor:
        (block_size,) = struct.unpack_from("<I", body)
        if block_size not in _BLOCK_SIZES:
            raise ValueError(f"Int8Blockwise payload with block size {block_size}")
        num_blocks = -(-numel // block_size)
        absmax, offset = _read(body, 4, np.float32, num_blocks)
        quantized, end = _read(body, offset, np.int8, numel)
        _expect_end(body, end)
        blocks, _ = _blocks(torch.from_numpy(quantized.astype(np.float32)), block_size)
        # q/127 first: 127·absmax could overflow float32
        return blocks.div_(127).mul_(torch.from_numpy(absmax.copy()).unsqueeze(1)).reshape(-1)[:numel]


def _blocks(flat: torch.Tensor, block_size: int) -> Tuple[torch.Tensor, int]:
    """``flat`` zero-padded to whole blocks, as a (num_blocks, block_size) matrix, and its original length."""
    numel = flat.numel()
    padding = -numel % block_size
    padded = torch.nn.functional.pad(flat, (0, padding)) if padding else flat
    return padded.reshape(-1, block_size), numel


class Uniform8Bit(_SlotCodec):
    """256 evenly spaced levels between the tensor's min and max (what hivemind's ``Uniform8BitQuantization``
    promises; that one centres on ±3σ, clips the tails and cannot decode under numpy 2).

    Error ≤ (max − min)/510 ≤ absmax/255: good for tensors without outliers (parameters), poor for gradients with a
    few large values, where ``Int8Blockwise`` is better. Costs 1 byte per value plus 8 bytes per tensor part.
    """

    nominal_error = 1.0 / 255
    tag = 3

    @property
    def bytes_per_value(self) -> float:
        return 1.0

    def error_bound(self, tensor: torch.Tensor) -> torch.Tensor:
        values = tensor.detach().double()
        spread = float(values.max() - values.min()) if values.numel() else 0.0
        return torch.full(tensor.shape, spread / 510)

    def _statistics(self, values: torch.Tensor) -> torch.Tensor:
        return torch.stack(torch.aminmax(values)) if values.numel() else torch.zeros(2)

    def _encode(self, values: torch.Tensor, statistics: torch.Tensor) -> bytes:
        low, high = (float(v) for v in statistics)
        span = high - low  # in float64; float32 arithmetic unless the span exceeds the float32 range
        work = values if span <= _FP32_MAX else values.double()
        levels = (work - low).mul_(255 / span) if span > 0 else torch.zeros_like(values)
        quantized = levels.round_().clamp_(0, 255).to(torch.uint8)
        return struct.pack("<ff", low, high) + quantized.numpy().tobytes()

    @classmethod
    def _decode(cls, body: memoryview, numel: int) -> torch.Tensor:
        low, high = struct.unpack_from("<ff", body)
        quantized, end = _read(body, 8, np.uint8, numel)
        _expect_end(body, end)
        levels = torch.from_numpy(quantized.astype(np.float64))
        return levels.mul_((high - low) / 255).add_(low).float()


class TopK(_SlotCodec):
    """Top-k sparsification with error feedback: each round a peer sends, per tensor, only the ``fraction`` of its
    values of largest magnitude (after adding its residual), as indices + values (COO), and keeps the rest for later
    rounds (``swarm_opt.compression.sparse``). For strategies whose rounds send changes (``Strategy.sends_changes``):
    gradient averaging, and DiLoCo's pseudo-gradients (the change since the last round; FedAvg as DiLoCo with an
    outer SGD of lr 1): ``compression=swarm_opt.TopK(fraction=0.01)``.

    The selection happens on the peer's values before they reach the wire; the wire itself is exact for them (this
    codec's ``compress`` drops nothing: a part goes as COO, 8 bytes per nonzero, or dense in float32 when that is
    smaller), so the group's mean of the sparse values, at most ``group size × k`` nonzeros per tensor, comes back to
    every member identically. A peer sends about ``8·fraction`` bytes per value and receives up to ``group size``
    times that; what a round does not send is delayed, not lost, so small fractions act like a delay of about
    ``1/fraction`` rounds on the smallest values (lower the learning rate if training becomes unstable).

    Only with the weighted mean: a robust aggregation (``CenteredClip``, ``TrimmedMean``) of sparse vectors with
    different supports would treat every value one peer sent as an outlier. ``Mean()``'s norm bound (10× the group's
    median) still applies, and what it cuts from a copy is lost, not fed back.

    :param fraction: share of each tensor's values sent per round, in (0, 1] (at least one value per tensor).
    """

    nominal_error = 0.0
    tag = 4

    def __init__(self, fraction: float = 0.01) -> None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise ConfigTypeError(f"TopK(fraction=...) must be a number, e.g. 0.01; got {fraction!r}")
        if not 0 < fraction <= 1:
            raise ConfigError(f"TopK(fraction={fraction!r}) must be in (0, 1]: the share of each tensor's values a "
                              f"round sends, e.g. 0.01")
        self.fraction = float(fraction)

    def __repr__(self) -> str:
        return f"swarm_opt.TopK(fraction={self.fraction:g})"

    @property
    def bytes_per_value(self) -> float:
        return 4.0  # a dense part; a sparse one costs 8 bytes per nonzero (see ``sparse_bytes``)

    @staticmethod
    def sparse_bytes(nonzeros: int) -> int:
        """Payload bytes of a part with this many nonzeros sent as COO (header and framing excluded)."""
        return 5 + 8 * nonzeros

    def error_bound(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(tensor, dtype=torch.float32)

    needs_changes = True

    def refusal(self, strategy: Any) -> str:
        return (f"{self!r} sends the largest values of each round's changes and keeps the rest for later rounds; "
                f"{type(strategy).__name__} here averages model states, whose values cannot be left out. Use it with "
                f"strategy=swarm_opt.GradientAveraging() or swarm_opt.DiLoCo(...) without groups, "
                f"average_optimizer_state, or frozen parameters (requires_grad=False) in the optimizer's params "
                f"(its rounds send pseudo-gradients; with outer_optimizer=lambda p: "
                f"torch.optim.SGD(p, lr=1.0) it is FedAvg), or compression=swarm_opt.Int8Blockwise() with this "
                f"strategy")

    def check_aggregation(self, aggregation: Any) -> Mean:
        """The weighted mean only (``Mean()``, with or without its norm bound; see the class docstring)."""
        if aggregation is None:
            return Mean()
        if not isinstance(aggregation, Mean):
            raise ConfigError(f"{self!r} sends sparse values with different supports per peer: "
                              f"aggregation={aggregation!r} would discard most of them as outliers. Leave aggregation "
                              f"unset (or Mean()) with TopK, or use compression=swarm_opt.Int8Blockwise() with it")
        return aggregation

    def feedback(self, buffers: Sequence[torch.Tensor]) -> SparseFeedback:  # type: ignore[override]
        return SparseFeedback(buffers, self.fraction)

    def _statistics(self, values: torch.Tensor) -> torch.Tensor:
        return values.abs().max() if values.numel() else torch.tensor(0.0)

    def _encode(self, values: torch.Tensor, statistics: torch.Tensor) -> bytes:
        indices = values.nonzero().reshape(-1)
        numel, nonzeros = values.numel(), indices.numel()
        if numel > _MAX_SPARSE_NUMEL or self.sparse_bytes(nonzeros) >= 1 + 4 * numel:
            return b"\x00" + values.numpy().tobytes()
        return (b"\x01" + struct.pack("<I", nonzeros) + indices.to(torch.int32).numpy().tobytes()
                + values[indices].numpy().tobytes())

    @classmethod
    def _decode(cls, body: memoryview, numel: int) -> torch.Tensor:
        (mode,) = struct.unpack_from("<B", body)
        if mode == 0:
            dense, end = _read(body, 1, np.float32, numel)
            _expect_end(body, end)
            return torch.from_numpy(dense.copy())
        if mode != 1:
            raise ValueError(f"TopK payload of unknown mode {mode}")
        (nonzeros,) = struct.unpack_from("<I", body, 1)
        if numel > _MAX_SPARSE_NUMEL or nonzeros > numel:
            raise ValueError(f"TopK payload with {nonzeros} nonzeros in a part of {numel} values")
        indices, offset = _read(body, 5, np.int32, nonzeros)
        values, end = _read(body, offset, np.float32, nonzeros)
        _expect_end(body, end)
        if nonzeros and (int(indices[0]) < 0 or int(indices[-1]) >= numel or bool((np.diff(indices) <= 0).any())):
            raise ValueError("TopK payload with indices out of range, repeated or out of order")
        dense = torch.zeros(numel, dtype=torch.float32)
        dense[torch.from_numpy(indices.astype(np.int64))] = torch.from_numpy(values.copy())
        return dense


#: every elementwise codec, once; the conformance tests and ``as_codec``'s error message iterate over it
CODECS: Tuple[Type[Codec], ...] = (NoCompression, Float16, Int8Blockwise, Uniform8Bit, TopK)
_CODEC_BY_TAG: Dict[int, Type[_SlotCodec]] = {c.tag: c for c in CODECS if issubclass(c, _SlotCodec)}
assert len(_CODEC_BY_TAG) == sum(issubclass(c, _SlotCodec) for c in CODECS), "two codecs share a tag"


class _SwarmSlot(CompressionBase):
    """What hivemind's table holds for UNIFORM_8BIT once swarm_opt is imported (see the module docstring)."""

    compression_type = runtime_pb2.CompressionType.Value(_SLOT_NAME)

    def __init__(self, legacy: CompressionBase) -> None:
        self.legacy = legacy
        self.encoder: Optional[_SlotCodec] = None  # the codec of this process's averager, once it claimed the slot

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        encoder = self.encoder
        if encoder is None:  # this process averages without our codecs: answer exactly
            return _EXACT.compress(tensor, info, allow_inplace)
        return encoder.compress(tensor, info, allow_inplace)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        if serialized_tensor.buffer[: len(_MAGIC)] == _MAGIC:
            return _extract_any(serialized_tensor)
        return self.legacy.extract(serialized_tensor)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        encoder = self.encoder
        return 1.0 if encoder is None else encoder.estimate_compression_ratio(info)


def _install_slot() -> _SwarmSlot:
    table: Dict[str, CompressionBase] = _hivemind_serialization._BASE_COMPRESSION_TYPES
    current = table[_SLOT_NAME]
    if not isinstance(current, _SwarmSlot):  # importing twice (reload, tests) keeps the first slot
        table[_SLOT_NAME] = _SwarmSlot(legacy=current)
    return table[_SLOT_NAME]  # type: ignore[return-value]


def _slot() -> _SwarmSlot:
    slot = _hivemind_serialization._BASE_COMPRESSION_TYPES[_SLOT_NAME]
    assert isinstance(slot, _SwarmSlot), "swarm_opt.compression's slot was replaced in hivemind's table"
    return slot


_install_slot()
