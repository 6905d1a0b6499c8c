"""Turn nested training state into (a plain skeleton, a list of tensors) and back, without pickle.

State downloaded from peers is untrusted, so it never goes through pickle: the skeleton holds only None, bools,
numbers, strings, lists and tagged dicts/tuples/tensor references, and ``unflatten`` rejects anything else.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import torch

_TENSOR, _DICT, _TUPLE = "__tensor__", "__dict__", "__tuple__"
_SCALARS = (type(None), bool, int, float, str)
_MAX_DEPTH = 64  # optimizer states nest a few levels; a donor's skeleton must not exhaust the stack


def flatten(obj: Any) -> Tuple[Any, List[torch.Tensor]]:
    tensors: List[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x.detach())
            return {_TENSOR: len(tensors) - 1}
        if isinstance(x, dict):
            return {_DICT: [[walk(k), walk(v)] for k, v in x.items()]}
        if isinstance(x, tuple):
            return {_TUPLE: [walk(v) for v in x]}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, _SCALARS):
            return x
        raise TypeError(f"cannot share training state of type {type(x).__name__}: {x!r}")

    return walk(obj), tensors


def unflatten(skeleton: Any, tensors: List[torch.Tensor]) -> Any:
    """Inverse of ``flatten``; raises ValueError on anything it did not produce (nesting too deep included)."""

    def walk(x: Any, depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise ValueError(f"state skeleton nested deeper than {_MAX_DEPTH} levels")
        if isinstance(x, dict):
            if set(x) == {_TENSOR}:
                index = x[_TENSOR]
                if not isinstance(index, int) or not 0 <= index < len(tensors):
                    raise ValueError(f"bad tensor reference {index!r}")
                return tensors[index]
            if set(x) == {_DICT} and isinstance(x[_DICT], list):
                pairs = x[_DICT]
                if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
                    raise ValueError("malformed dict entry")
                return {_hashable(walk(k, depth + 1)): walk(v, depth + 1) for k, v in pairs}
            if set(x) == {_TUPLE} and isinstance(x[_TUPLE], list):
                return tuple(walk(v, depth + 1) for v in x[_TUPLE])
            raise ValueError(f"unexpected mapping with keys {sorted(map(str, x))}")
        if isinstance(x, list):
            return [walk(v, depth + 1) for v in x]
        if isinstance(x, _SCALARS):
            return x
        raise ValueError(f"unexpected {type(x).__name__} in state skeleton")

    return walk(skeleton)


def _hashable(key: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        raise ValueError("dict keys must be scalars or tuples of them") from None
    return key

