"""Crash-safe checkpoints of a swarm peer's full training state.

A checkpoint holds the model, the optimizer's state (inner optimizer, scheduler, global epoch, strategy state such as
SCAFFOLD controls or the DiLoCo anchor) and any small ``extra`` state of the caller (e.g. its data position). Files
are written atomically: a temporary file in the same directory, flushed and fsynced, then renamed over the final name
and the directory fsynced, so a process killed at any moment leaves either the previous checkpoint or the new one,
never a torn file. Loading uses ``torch.load(weights_only=True)`` (no arbitrary pickle) and refuses a checkpoint of
another model with a clear error.
"""

from __future__ import annotations

import math
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from swarm_opt.errors import ConfigError, IncompatibleStateError

_FORMAT = 1
_NAME = re.compile(r"^epoch-(\d{8})\.pt$")
_claimed: Dict[Path, int] = {}  # directory -> id of the Checkpointer writing there
_claimed_lock = threading.Lock()


@dataclass(frozen=True)
class BestMetric:
    """Keep ``best.pt``: the checkpoint with the best value of ``name`` (``mode="min"`` for a loss, ``"max"`` for an
    accuracy)."""

    name: str
    mode: str = "min"

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ConfigError(f"BestMetric mode must be 'min' or 'max', got {self.mode!r}")
        if not self.name:
            raise ConfigError("BestMetric needs the name of a metric, e.g. BestMetric('accuracy', mode='max')")

    def better(self, value: float, than: Optional[float]) -> bool:
        if than is None:
            return True
        return value < than if self.mode == "min" else value > than


class Checkpointer:
    """Save the training state every ``every_epochs`` global epochs into ``directory``, keeping the last
    ``keep_last`` checkpoints (and ``best.pt`` if ``best`` is given).

    Two checkpointers may not write to the same directory (they would delete each other's files).

    >>> ckpt = Checkpointer("ckpt/", every_epochs=5, keep_last=3, best=BestMetric("accuracy", mode="max"))
    >>> ckpt.restore(opt, model)                     # resume, if a checkpoint exists
    >>> ... opt.step(); ckpt.maybe_save(opt, model, metrics={"accuracy": acc})
    """

    def __init__(self, directory: os.PathLike | str, *, every_epochs: int = 1, keep_last: int = 3,
                 best: Optional[BestMetric] = None) -> None:
        if isinstance(every_epochs, bool) or not isinstance(every_epochs, int) or every_epochs <= 0:
            raise ConfigError(f"every_epochs must be a positive int, got {every_epochs!r}")
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 0:
            raise ConfigError(f"keep_last must be a non-negative int (0 keeps only best.pt), got {keep_last!r}")
        if keep_last == 0 and best is None:
            raise ConfigError("keep_last=0 without best=BestMetric(...) would keep nothing; raise keep_last")
        self.directory = Path(directory).resolve()
        self.every_epochs, self.keep_last, self.best = every_epochs, keep_last, best
        with _claimed_lock:
            if self.directory in _claimed:
                raise ConfigError(f"another Checkpointer already writes to {self.directory}; give each its own "
                                  f"directory")
            _claimed[self.directory] = id(self)
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob("*.tmp"):  # left by a process killed mid-save
            stale.unlink(missing_ok=True)
        self._last_saved_epoch: Optional[int] = None
        self._best_value = self._read_best_value()

    def close(self) -> None:
        """Release the directory (another Checkpointer may then write there)."""
        directory = getattr(self, "directory", None)  # None if __init__ failed before claiming
        with _claimed_lock:
            if directory is not None and _claimed.get(directory) == id(self):
                del _claimed[directory]

    def __del__(self) -> None:
        self.close()

    # --- saving -------------------------------------------------------------------------------------------------------
    def maybe_save(self, opt: Any, model: torch.nn.Module, *, metrics: Optional[Dict[str, float]] = None,
                   extra: Optional[Dict[str, Any]] = None) -> Optional[Path]:
        """Save if the optimizer reached a new epoch that is a multiple of ``every_epochs``; returns the path."""
        epoch = opt.local_epoch
        if epoch == self._last_saved_epoch or epoch % self.every_epochs:
            return None
        return self.save(opt, model, metrics=metrics, extra=extra)

    def save(self, opt: Any, model: torch.nn.Module, *, metrics: Optional[Dict[str, float]] = None,
             extra: Optional[Dict[str, Any]] = None) -> Path:
        state = {
            "format": _FORMAT, "model_schema": opt.model_schema, "epoch": opt.local_epoch,
            "model": model.state_dict(), "optimizer": opt.state_dict(), "metrics": dict(metrics or {}),
            "extra": dict(extra or {}),
        }
        path = self.directory / f"epoch-{opt.local_epoch:08d}.pt"
        if self.keep_last:
            _atomic_save(state, path)
        self._last_saved_epoch = opt.local_epoch
        if self.best is not None and metrics is not None and self.best.name in metrics:
            value = float(metrics[self.best.name])
            if math.isfinite(value) and self.best.better(value, self._best_value):
                _atomic_save(state, self.directory / "best.pt")
                self._best_value = value
        self._prune()
        return path if self.keep_last else self.directory / "best.pt"

    def _prune(self) -> None:
        for old in self.checkpoints()[:-self.keep_last] if self.keep_last else self.checkpoints():
            old.unlink(missing_ok=True)

    # --- loading ------------------------------------------------------------------------------------------------------
    def checkpoints(self) -> List[Path]:
        """Numbered checkpoints, oldest first."""
        return sorted(p for p in self.directory.iterdir() if _NAME.match(p.name))

    def latest(self) -> Optional[Path]:
        found = self.checkpoints()
        return found[-1] if found else None

    def restore(self, opt: Any, model: torch.nn.Module, path: Optional[os.PathLike | str] = None) -> Optional[dict]:
        """Load ``path`` (default: the latest checkpoint) into the model and optimizer. Returns the checkpoint's
        ``{"epoch", "metrics", "extra"}``, or None if there is none. If the swarm has moved on meanwhile, the
        optimizer catches up from peers at its next step, as any peer that fell behind does."""
        path = Path(path) if path is not None else self.latest()
        if path is None:
            return None
        state = load_checkpoint(path, expected_schema=opt.model_schema)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        return {"epoch": state["epoch"], "metrics": state["metrics"], "extra": state["extra"]}

    def _read_best_value(self) -> Optional[float]:
        path = self.directory / "best.pt"
        if self.best is None or not path.exists():
            return None
        try:
            return float(torch.load(path, weights_only=True)["metrics"][self.best.name])
        except Exception:  # an unreadable best.pt is replaced by the next better checkpoint
            return None


def load_checkpoint(path: os.PathLike | str, *, expected_schema: Optional[str] = None) -> dict:
    """Read and validate a checkpoint written by ``Checkpointer``."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise IncompatibleStateError(f"{path} is not a readable swarm_opt checkpoint: {e}") from e
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise IncompatibleStateError(f"{path} is not a swarm_opt checkpoint (format {_FORMAT})")
    missing = {"model_schema", "epoch", "model", "optimizer"} - set(state)
    if missing:
        raise IncompatibleStateError(f"{path} lacks {sorted(missing)}")
    if expected_schema is not None and state["model_schema"] != expected_schema:
        raise IncompatibleStateError(
            f"{path} holds a different model or strategy (parameter shapes/dtypes differ); load it into the model "
            f"it was saved from, or start a fresh checkpoint directory"
        )
    state.setdefault("metrics", {})
    state.setdefault("extra", {})
    return state


def _atomic_save(state: dict, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
