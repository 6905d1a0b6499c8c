"""What peers send instead of their full-precision tensors: pass one as ``swarm_opt.Optimizer(compression=...)``.

``codecs`` holds the elementwise codecs (``NoCompression``, ``Float16``, ``Int8Blockwise``, ``Uniform8Bit``,
``TopK``: each a hivemind ``CompressionBase`` with a stated error bound), ``sparse`` the error feedback of ``TopK``,
and ``powersgd`` PowerSGD's configuration and maths (its two-phase averaging protocol is in
``swarm_opt._hivemind.powersgd_engine``, which the transport picks for it). ``base.Compression`` is what all of them
declare to the layers that use them (lane dtype, feedback, what they need of a strategy).
"""

from __future__ import annotations

from typing import Any, Optional

from swarm_opt.compression.base import Compression
from swarm_opt.compression.codecs import CODECS, Codec, Float16, Int8Blockwise, NoCompression, TopK, Uniform8Bit
from swarm_opt.compression.powersgd import PowerSGD
from swarm_opt.errors import ConfigTypeError

__all__ = ["Codec", "NoCompression", "Float16", "Int8Blockwise", "Uniform8Bit", "TopK", "PowerSGD", "CODECS",
           "Compression", "as_codec"]


def as_codec(compression: Optional[Compression], strategy: Any) -> Compression:
    """The codec to use for ``compression=`` with ``strategy`` (None means ``NoCompression()``); anything else, or
    PowerSGD with a strategy that does not average gradients, is refused."""
    if compression is None:
        return NoCompression()
    if isinstance(compression, Compression):
        compression.check_strategy(strategy)
        return compression
    choices = ", ".join([*(f"swarm_opt.{c.__name__}()" for c in CODECS), "swarm_opt.PowerSGD(rank=4)"])
    hint = f" (pass an instance: {compression.__name__}())" if isinstance(compression, type) else ""
    raise ConfigTypeError(f"compression must be one of {choices}; got {compression!r}{hint}")
