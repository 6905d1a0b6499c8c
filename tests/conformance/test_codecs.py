"""Every codec through the same checks: one registry (``swarm_opt.CODECS``), one file.

Each codec states a per-value error bound (``error_bound``) and a nominal one (``nominal_error`` × absmax); here
both are checked on random and adversarial tensors, decoded the way a receiving peer decodes them (hivemind's
``deserialize_torch_tensor``, by the enum on the wire), together with bytes on the wire, determinism, the rejection
of NaN/inf and of bad arguments, and the path a reducer takes when it re-encodes the difference it sends back.
"""

from __future__ import annotations

from typing import Iterator, List

import numpy as np
import pytest
import torch
from hivemind.compression import (
    CompressionInfo,
    Float16Compression,
    Uniform8BitQuantization,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from hivemind.proto import runtime_pb2

import swarm_opt
from swarm_opt.compression import codecs
from swarm_opt.errors import ConfigError, ConfigTypeError, NonFiniteTensorError

#: every registered codec with its defaults, plus non-default settings worth their own run
INSTANCES: List[swarm_opt.Codec] = [codec() for codec in swarm_opt.CODECS] + [swarm_opt.Int8Blockwise(block_size=64)]
IDS = [repr(c).replace("swarm_opt.", "") for c in INSTANCES]
SHAPES = [(), (1,), (7,), (1000,), (33, 65), (3, 4, 300)]  # 1000, 33·65, 3600: not multiples of any block size
SCALES = [1e-3, 1.0, 1e4]
#: float32 arithmetic on top of each codec's bound: a few ulps of the largest magnitude
FP32_SLACK = 4 * torch.finfo(torch.float32).eps


def round_trip(codec: swarm_opt.Codec, x: torch.Tensor) -> torch.Tensor:
    """What a peer receives: encode with the codec, decode with hivemind's table, by the enum on the wire."""
    serialized = codec.compress(x, CompressionInfo.from_tensor(x))
    y = deserialize_torch_tensor(runtime_pb2.Tensor.FromString(serialized.SerializeToString()))
    assert y.shape == x.shape and y.dtype == x.dtype
    return y


def assert_within_bound(codec: swarm_opt.Codec, x: torch.Tensor) -> torch.Tensor:
    y = round_trip(codec, x)
    error = (y.double() - x.double()).abs()
    absmax = float(x.double().abs().max()) if x.numel() else 0.0
    bound = codec.error_bound(x).double()
    assert bool((bound <= codec.nominal_error * absmax * (1 + 1e-6) + 1e-30).all()), "per-value bound above nominal"
    excess = error - bound - FP32_SLACK * absmax
    assert bool((excess <= 0).all()), f"error {float(error.max()):.3g} exceeds the bound at {int(excess.argmax())}"
    return error


@pytest.fixture(autouse=True)
def restore_slot_encoder() -> Iterator[None]:
    """``estimate_compression_ratio`` claims hivemind's shared slot for the codec (process-global, by design)."""
    slot = codecs._slot()
    saved = slot.encoder
    yield
    slot.encoder = saved


@pytest.mark.parametrize("codec", INSTANCES, ids=IDS)
class TestEveryCodec:
    @pytest.mark.parametrize("scale", SCALES)
    @pytest.mark.parametrize("shape", SHAPES, ids=str)
    def test_random_normal_within_bound(self, codec, shape, scale):
        g = torch.Generator().manual_seed(hash((shape, scale)) % 2**31)
        assert_within_bound(codec, torch.randn(shape, generator=g) * scale)

    @pytest.mark.parametrize("x", [torch.zeros(1000), torch.full((515,), 3.7), torch.full((300,), -1e-20),
                                   torch.tensor([65504.0 * 16, -1e30, 3e38, 1e-30]), torch.empty(0)],
                             ids=["zeros", "constant", "tiny-constant", "beyond-fp16-range", "empty"])
    def test_adversarial_within_bound(self, codec, x):
        error = assert_within_bound(codec, x)
        if x.numel() and bool((x == 0).all()):
            assert float(error.max()) == 0.0

    def test_one_huge_value_spoils_at_most_its_own_scaling_group(self, codec):
        x = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 1e-3
        x[100] = 1e6
        error = assert_within_bound(codec, x)
        block = getattr(codec, "block_size", None)
        if block is not None:  # blockwise: every other block keeps its own 8-bit precision
            outside = torch.ones(4096, dtype=torch.bool)
            outside[(100 // block) * block:(100 // block + 1) * block] = False
            others = float(x[outside].abs().max())
            assert float(error[outside].max()) <= others * (codec.nominal_error + FP32_SLACK)

    @pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
    def test_non_finite_is_refused_at_the_sender(self, codec, bad):
        x = torch.randn(300)
        x[17] = bad
        with pytest.raises(NonFiniteTensorError, match="NaN") as caught:
            codec.compress(x, CompressionInfo.from_tensor(x))
        assert isinstance(caught.value, ValueError)

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
    def test_other_float_dtypes_come_back_in_their_dtype(self, codec, dtype):
        x = (torch.randn(500, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
        y = round_trip(codec, x)
        # the codec's bound, plus rounding the decoded value back into a coarser dtype
        ulp = torch.finfo(dtype).eps if dtype != torch.float64 else 0.0
        error = (y.double() - x.double()).abs()
        bound = codec.error_bound(x).double() + (ulp + FP32_SLACK) * float(x.double().abs().max())
        assert bool((error <= bound).all())

    def test_integer_tensors_are_sent_exactly(self, codec):
        x = torch.arange(-50, 50, dtype=torch.int64)
        assert torch.equal(round_trip(codec, x), x)

    def test_bytes_on_the_wire_match_the_stated_size(self, codec):
        x = torch.randn(1 << 16)
        info = CompressionInfo.from_tensor(x)
        wire = len(codec.compress(x, info).SerializeToString()) / x.numel()
        assert wire == pytest.approx(codec.bytes_per_value, rel=0.01)
        assert codec.estimate_compression_ratio(info) * 4 == pytest.approx(codec.bytes_per_value)

    def test_deterministic_bytes(self, codec):
        x = torch.randn(5000, generator=torch.Generator().manual_seed(3)) * 7
        first = codec.compress(x, CompressionInfo.from_tensor(x)).SerializeToString()
        again = type(codec)(**vars(codec)).compress(x.clone(), CompressionInfo.from_tensor(x)).SerializeToString()
        assert first == again

    def test_reducer_re_encodes_differences_with_the_claimed_codec(self, codec):
        """hivemind's reducer calls ``serialize_torch_tensor(delta, incoming_enum)``: the enum's table entry must
        encode with this process's codec, which claims it when hivemind asks for its ratio."""
        delta = torch.randn(777, generator=torch.Generator().manual_seed(4))
        info = CompressionInfo.from_tensor(delta)
        codec.estimate_compression_ratio(info)  # what TensorPartContainer does at the start of each round
        reencoded = serialize_torch_tensor(delta, codec.compression_type)
        assert reencoded.SerializeToString() == codec.compress(delta, info).SerializeToString()


def test_registry_is_exported_and_tags_are_unique():
    assert set(swarm_opt.CODECS) <= {getattr(swarm_opt, name) for name in swarm_opt.__all__}
    assert all(issubclass(c, swarm_opt.Codec) for c in swarm_opt.CODECS)
    tags = [c.tag for c in swarm_opt.CODECS if hasattr(c, "tag")]
    assert len(tags) == len(set(tags))


def test_unclaimed_slot_answers_exactly():
    """A process whose averager uses none of our codecs still decodes ours, and sends differences back exact."""
    codecs._slot().encoder = None
    delta = torch.randn(100)
    reencoded = serialize_torch_tensor(delta, runtime_pb2.UNIFORM_8BIT)
    assert reencoded.compression == runtime_pb2.NONE
    assert torch.equal(deserialize_torch_tensor(reencoded), delta)


@pytest.mark.parametrize("corrupt", [lambda b: b[:-1], lambda b: b + b"\0", lambda b: b[:4] + b"\x63" + b[5:],
                                     lambda b: b[:6]], ids=["truncated", "trailing", "unknown-tag", "header-only"])
def test_malformed_payloads_raise_value_error(corrupt):
    x = torch.randn(300)
    for codec in (swarm_opt.Float16(), swarm_opt.Int8Blockwise(), swarm_opt.Uniform8Bit()):
        serialized = codec.compress(x, CompressionInfo.from_tensor(x))
        serialized.buffer = corrupt(serialized.buffer)
        with pytest.raises(ValueError):
            deserialize_torch_tensor(serialized)


@pytest.mark.parametrize("block_size, error", [(0, ConfigError), (4, ConfigError), (2**25, ConfigError),
                                               (64.0, ConfigTypeError), ("64", ConfigTypeError),
                                               (True, ConfigTypeError)])
def test_bad_block_sizes_are_refused(block_size, error):
    with pytest.raises(error, match="block_size"):
        swarm_opt.Int8Blockwise(block_size=block_size)


def test_optimizer_refuses_foreign_codecs_and_names_the_choices():
    from unittest.mock import create_autospec

    from hivemind import DHT

    model = torch.nn.Linear(2, 1)
    common = dict(dht=create_autospec(DHT, instance=True), run_id="codec_check", target_batch_size=8,
                  optimizer=lambda p: torch.optim.SGD(p, lr=0.1), params=list(model.parameters()))
    with pytest.raises(ConfigTypeError, match=r"swarm_opt\.Float16\(\).*swarm_opt\.Int8Blockwise\(\)"):
        swarm_opt.Optimizer(**common, compression=Float16Compression())
    with pytest.raises(ConfigTypeError, match=r"pass an instance: Float16\(\)"):
        swarm_opt.Optimizer(**common, compression=swarm_opt.Float16)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")  # torch deprecates what hivemind's codec uses
def test_hivemind_uniform8bit_is_why_we_replaced_it():
    """hivemind's ``Uniform8BitQuantization`` cannot decode its own payload under numpy 2, and decoded by hand its
    error on a unit normal (it clips the tails at ±3σ) is ~100× its 8-bit step."""
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(5))
    serialized = Uniform8BitQuantization().compress(x, CompressionInfo.from_tensor(x))
    if int(np.__version__.split(".")[0]) >= 2:
        with pytest.raises(TypeError):
            Uniform8BitQuantization().extract(serialized)
    codebook = np.frombuffer(serialized.buffer, offset=8, count=256, dtype=np.float32)
    indices = np.frombuffer(serialized.buffer, offset=8 + 256 * 4, dtype=np.uint8)
    hivemind_error = float((torch.from_numpy(codebook[indices].copy()) - x).abs().max())
    ours = float((round_trip(swarm_opt.Uniform8Bit(), x) - x).abs().max())
    eight_bit_step = float(x.max() - x.min()) / 255
    assert ours <= eight_bit_step / 2 * (1 + 1e-4)
    assert hivemind_error > 10 * eight_bit_step, (hivemind_error, eight_bit_step)


def test_a_hostile_block_size_is_refused_before_allocating():
    x = torch.randn(300)
    serialized = swarm_opt.Int8Blockwise().compress(x, CompressionInfo.from_tensor(x))
    serialized.buffer = serialized.buffer[:5] + (2**31).to_bytes(4, "little") + serialized.buffer[9:]
    with pytest.raises(ValueError, match="block size"):
        deserialize_torch_tensor(serialized)


# --- TopK: the wire is exact for the sparse values it is meant for; hostile COO payloads are refused ---------------
@pytest.mark.parametrize("nonzeros", [0, 1, 50, 3000])
def test_topk_sends_sparse_values_as_coo_exactly(nonzeros):
    g = torch.Generator().manual_seed(nonzeros)
    x = torch.zeros(10_000)
    x[torch.randperm(10_000, generator=g)[:nonzeros]] = torch.randn(nonzeros, generator=g) * 1e3
    codec = swarm_opt.TopK(fraction=0.01)
    serialized = codec.compress(x, CompressionInfo.from_tensor(x))
    assert torch.equal(round_trip(codec, x), x)
    # 8 bytes per nonzero (int32 index + float32 value) and a 5-byte mode + count, after the 5-byte codec header
    assert len(serialized.buffer) == 5 + codec.sparse_bytes(nonzeros)


def test_topk_sends_a_dense_part_dense_when_that_is_smaller():
    x = torch.randn(1000)
    x[::3] = 0.0  # two thirds nonzero: COO would cost 8 x 667 > 4 x 1000 bytes
    assert len(swarm_opt.TopK().compress(x, CompressionInfo.from_tensor(x)).buffer) == 5 + 1 + 4 * 1000


def _coo(indices, values, numel=100):
    x = torch.zeros(numel)
    serialized = swarm_opt.TopK().compress(x, CompressionInfo.from_tensor(x))
    body = b"\x01" + len(indices).to_bytes(4, "little") + np.asarray(indices, np.int32).tobytes() + \
        np.asarray(values, np.float32).tobytes()
    serialized.buffer = serialized.buffer[:5] + body
    return serialized


@pytest.mark.parametrize("serialized", [
    _coo([3, 100], [1.0, 2.0]), _coo([-1], [1.0]), _coo([5, 5], [1.0, 2.0]), _coo([7, 2], [1.0, 2.0]),
    _coo([1], [1.0, 2.0]), _coo([1, 2], [1.0]), _coo(list(range(101)), [0.0] * 101),
], ids=["index-out-of-range", "negative-index", "repeated", "out-of-order", "trailing", "truncated", "too-many"])
def test_topk_refuses_hostile_coo_payloads(serialized):
    with pytest.raises(ValueError):
        deserialize_torch_tensor(serialized)


def test_topk_refuses_a_payload_claiming_a_huge_part():
    serialized = _coo([1], [1.0])
    del serialized.size[:]
    serialized.size.extend([2**30])
    with pytest.raises(ValueError, match="nonzeros in a part"):
        deserialize_torch_tensor(serialized)


@pytest.mark.parametrize("fraction, error", [(0, ConfigError), (1.5, ConfigError), (-0.1, ConfigError),
                                             ("0.1", ConfigTypeError), (True, ConfigTypeError)])
def test_bad_topk_fractions_are_refused(fraction, error):
    with pytest.raises(error, match="fraction"):
        swarm_opt.TopK(fraction=fraction)
