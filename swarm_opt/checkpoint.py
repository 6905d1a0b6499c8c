"""Crash-safe checkpoints of a swarm peer's full training state, and checkpointers that keep the best one by a score.

A checkpoint holds the model, the optimizer's state (inner optimizer, scheduler, global epoch, strategy state such as
SCAFFOLD controls or the DiLoCo anchor) and any small ``extra`` state of the caller (e.g. its data position). Files
are written atomically: a temporary file in the same directory, flushed and fsynced, then renamed over the final name
and the directory fsynced, so a process killed at any moment leaves either the previous checkpoint or the new one,
never a torn file. Loading uses ``torch.load(weights_only=True)`` (no arbitrary pickle) and refuses a checkpoint of
another model with a clear error.

Two kinds of writers, any number of them side by side (FL4Health's model checkpointers, without a server):

* ``Checkpointer``: numbered checkpoints every few epochs, the last few kept (what a restart resumes from);
* ``ScoredCheckpointer``: one file, ``<name>.pt``, holding the state with the best score so far: ``BestLoss()``,
  ``BestMetric("accuracy", mode="max")``, ``Latest()``, or any function ``(epoch, metrics) -> float`` (higher is
  better, None: not scored this time).

Two writers of the same files would overwrite and prune each other's: each writer holds an exclusive lock on a
lock file next to what it writes (``.epochs.lock`` for the numbered checkpoints of a directory, ``.<name>.pt.lock``
for a scored file), which a second writer, in this process or another one, cannot take: it is refused with an error
that names the fix. The kernel releases the lock when the writer closes or its process dies, killed or not.

A write that fails (a full disk, a directory made read-only, an I/O error) raises ``CheckpointWriteError``, one line
naming the cause, the fix and the newest checkpoint still intact; it leaves no partial file and deletes nothing, so a
caller may log it and train on (the next save tries again).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import math
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch

from swarm_opt.errors import CheckpointWriteError, ConfigError, IncompatibleStateError
from swarm_opt.ranks import SOLO

logger = logging.getLogger(__name__)

_FORMAT = 1
_NAME = re.compile(r"^epoch-(\d{8})\.pt$")
_SCORED_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,100}$")
_held: Dict[Path, int] = {}  # lock file -> its descriptor, for every writer of this process
_held_lock = threading.Lock()
Metrics = Mapping[str, float]
#: a scoring function: higher is better; None means "not scored this time" (nothing is saved)
ScoreFunction = Callable[[int, Metrics], Optional[float]]


@dataclass(frozen=True)
class BestMetric:
    """Score by ``metrics[name]``: ``mode="min"`` keeps the lowest value (a loss), ``"max"`` the highest (an
    accuracy). A save without that metric, or with a non-finite value, is not scored."""

    name: str
    mode: str = "min"

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ConfigError(f"BestMetric mode must be 'min' or 'max', got {self.mode!r}")
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("BestMetric needs the name of a metric, e.g. BestMetric('accuracy', mode='max')")

    def __call__(self, epoch: int, metrics: Metrics) -> Optional[float]:
        value = metrics.get(self.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        return -float(value) if self.mode == "min" else float(value)

    @property
    def default_name(self) -> str:
        return f"best-{self.name}"


@dataclass(frozen=True)
class BestLoss(BestMetric):
    """Score by the lowest ``metrics[name]`` (default ``"loss"``)."""

    name: str = "loss"
    mode: str = field(default="min", init=False)


@dataclass(frozen=True)
class Latest:
    """Score by the epoch: keep the most recent save."""

    def __call__(self, epoch: int, metrics: Metrics) -> Optional[float]:
        return float(epoch)

    @property
    def default_name(self) -> str:
        return "latest"


Score = Union[BestMetric, Latest, ScoreFunction]


class _WriterLock:
    """An exclusive lock on the file ``path``, held until ``release`` (or until the process dies): a POSIX record lock
    (``lockf``) against other processes, which a forked child (the averager) does not inherit, plus this process's
    own registry, since record locks never conflict within one process."""

    def __init__(self, path: Path, refusal: str) -> None:
        self._path: Optional[Path] = None
        with _held_lock:
            if path in _held:
                raise ConfigError(refusal)
            # opened only once no writer of this process holds it: closing any descriptor of the file would drop
            # the process's record lock
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:  # a read-only or forbidden directory: refused before any training
                raise _write_error(f"cannot write checkpoints in {path.parent}", e) from None
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
                raise ConfigError(refusal) from None
            _held[path] = fd
        self._path = path

    def release(self) -> None:
        path, self._path = self._path, None
        if path is not None:
            with _held_lock:
                os.close(_held.pop(path))


def _make_directory(directory: os.PathLike | str) -> Path:
    path = Path(directory).resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _write_error(f"cannot create the checkpoint directory {path}", e) from None
    return path


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{what} must be a positive int, got {value!r}")
    return value


def _writes_here(writer: Optional[bool]) -> bool:
    """Whether this process writes checkpoints: ``writer`` if given; by default every process but the ranks other
    than 0 of an initialised ``torch.distributed`` (a machine's ranks are one peer, ``swarm_opt.ranks``: its rank 0
    writes for all of them, and every rank restores)."""
    if writer is not None:
        if not isinstance(writer, bool):
            raise ConfigError(f"writer must be True, False or None (rank 0 of torch.distributed), got {writer!r}")
        return writer
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0)


def _local_group(opt: Any) -> Any:
    """The machine's ranks of ``opt`` (``swarm_opt.ranks``; ``SOLO`` for one process, or anything but an
    ``Optimizer``)."""
    return getattr(opt, "_ranks", SOLO)


def _saves(opt: Any) -> bool:
    """Whether ``opt`` writes its own state (not a follower rank of a machine, ``swarm_opt.ranks``)."""
    return _local_group(opt).writes_checkpoints


def _training_state(opt: Any, model: torch.nn.Module, metrics: Optional[Metrics],
                    extra: Optional[Dict[str, Any]]) -> dict:
    return {
        "format": _FORMAT, "model_schema": opt.model_schema, "epoch": opt.local_epoch,
        "model": _local_group(opt).model_state(model), "optimizer": opt.state_dict(), "metrics": dict(metrics or {}),
        "extra": dict(extra or {}),
    }


def _restore(opt: Any, model: torch.nn.Module, path: Optional[Path], schemas: Sequence[str] = ()) -> Optional[dict]:
    if path is None:
        return None
    # a checkpoint of this model saved by an older release (another protocol, the same shapes) resumes too
    accepted = (opt.model_schema, *getattr(opt, "legacy_schemas", {}), *schemas)
    state = load_checkpoint(path, expected_schema=accepted)
    _local_group(opt).load_model_state(model, state["model"])  # (every rank its shards of a sharded model)
    opt.load_state_dict(state["optimizer"])
    return {"epoch": state["epoch"], "metrics": state["metrics"], "extra": state["extra"]}


class ScoredCheckpointer:
    """Keep one checkpoint, ``directory/<name>.pt``: the training state with the best ``score`` so far.

    :param score: ``BestLoss()``, ``BestMetric("accuracy", mode="max")``, ``Latest()``, or a function
        ``(epoch, metrics) -> float | None`` (higher is better; None: this save is not scored).
    :param name: the file's name without ``.pt``; default the score's (``best-loss``, ``best-accuracy``,
        ``latest``), required for a plain function. Each name has one writer at a time.
    :param every_epochs: ``maybe_save`` considers only epochs that are a multiple of this.
    :param writer: whether this process writes (see ``Checkpointer``); default: all but the ranks other than 0 of
        ``torch.distributed``.

    The best score kept is read back from the file when a checkpointer starts, so a restarted run only replaces it
    with a better state.

    >>> best = ScoredCheckpointer("ckpt/", score=BestMetric("accuracy", mode="max"))
    >>> ... opt.step(); best.maybe_save(opt, model, metrics={"accuracy": acc})
    """

    def __init__(self, directory: os.PathLike | str, *, score: Score, name: Optional[str] = None,
                 every_epochs: int = 1, writer: Optional[bool] = None) -> None:
        if not callable(score):
            raise ConfigError(f"score must be BestLoss(), BestMetric(...), Latest() or a function (epoch, metrics) "
                              f"-> float; got {score!r}")
        name = name if name is not None else getattr(score, "default_name", None)
        if name is None:
            raise ConfigError("a ScoredCheckpointer with a scoring function needs name=..., e.g. name='best-f1'")
        if not isinstance(name, str) or not _SCORED_NAME.match(name) or _NAME.match(f"{name}.pt"):
            raise ConfigError(f"checkpoint name {name!r} must be a plain file name of letters, digits, '_', '-' and "
                              f"'.', other than epoch-NNNNNNNN (the numbered checkpoints' names)")
        self.score, self.every_epochs = score, _positive_int(every_epochs, "every_epochs")
        directory = _make_directory(directory)
        self.path = directory / f"{name}.pt"
        self.writer = _writes_here(writer)
        self._lock: Optional[_WriterLock] = None
        if self.writer:
            self._lock = _WriterLock(directory / f".{self.path.name}.lock",
                                     f"another checkpointer already writes {self.path} (in this or another process); "
                                     f"give each its own name= or directory, or close() the other first")
            for stale in directory.glob(f".{self.path.name}.*.tmp"):  # left by a writer killed mid-save
                stale.unlink(missing_ok=True)
        self._last_epoch: Optional[int] = None
        self.best_score = self._read_score()

    def maybe_save(self, opt: Any, model: torch.nn.Module, *, metrics: Optional[Metrics] = None,
                   extra: Optional[Dict[str, Any]] = None) -> Optional[Path]:
        """At a new epoch that is a multiple of ``every_epochs``: save if the score beats the kept one. Returns the
        path if it saved."""
        epoch = opt.local_epoch
        if epoch == self._last_epoch or epoch % self.every_epochs or not (self.writer and _saves(opt)):
            return None
        self._last_epoch = epoch
        return self.consider(_training_state(opt, model, metrics, extra))

    def consider(self, state: dict) -> Optional[Path]:
        """Write ``state`` (a checkpoint's contents) if its score beats the kept one; returns the path if it did."""
        value = self.score(state["epoch"], state["metrics"])
        if not self.writer or value is None or not math.isfinite(value) or \
                (self.best_score is not None and not value > self.best_score):
            return None
        _atomic_save(state, self.path, intact=self.path if self.path.exists() else None)
        self.best_score = float(value)
        return self.path

    def restore(self, opt: Any, model: torch.nn.Module) -> Optional[dict]:
        """Load the kept checkpoint into the model and optimizer (see ``Checkpointer.restore``); None if none."""
        return _restore(opt, model, self.path if self.path.exists() else None)

    def close(self) -> None:
        """Release the name (another checkpointer may then write it)."""
        lock = getattr(self, "_lock", None)  # None if __init__ failed before locking
        if lock is not None:
            lock.release()

    def __del__(self) -> None:
        self.close()

    def _read_score(self) -> Optional[float]:
        if not self.path.exists():
            return None
        try:
            state = load_checkpoint(self.path)
        except IncompatibleStateError:  # an unreadable file is replaced by the next scored save
            return None
        value = self.score(int(state["epoch"]), state["metrics"])  # a bug in the scoring function surfaces
        return None if value is None or not math.isfinite(value) else float(value)


class Checkpointer:
    """Save the training state every ``every_epochs`` global epochs into ``directory``, keeping the last
    ``keep_last`` checkpoints (and ``best.pt`` if ``best`` is given).

    Two Checkpointers may not write to the same directory (they would delete each other's files); scored
    checkpointers of other names may share it. The ranks of one machine (``swarm_opt.LocalGroup``) each build one:
    rank 0 writes (``writer``, default: all but the ranks other than 0 of ``torch.distributed``), and every rank
    restores the same file.

    >>> ckpt = Checkpointer("ckpt/", every_epochs=5, keep_last=3, best=BestMetric("accuracy", mode="max"))
    >>> ckpt.restore(opt, model)                     # resume, if a checkpoint exists
    >>> ... opt.step(); ckpt.maybe_save(opt, model, metrics={"accuracy": acc})
    """

    def __init__(self, directory: os.PathLike | str, *, every_epochs: int = 1, keep_last: int = 3,
                 best: Optional[Score] = None, writer: Optional[bool] = None) -> None:
        _positive_int(every_epochs, "every_epochs")
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 0:
            raise ConfigError(f"keep_last must be a non-negative int (0 keeps only best.pt), got {keep_last!r}")
        if keep_last == 0 and best is None:
            raise ConfigError("keep_last=0 without best=BestMetric(...) would keep nothing; raise keep_last")
        self.directory = _make_directory(directory)
        self.every_epochs, self.keep_last = every_epochs, keep_last
        self.writer = _writes_here(writer)
        self._lock: Optional[_WriterLock] = None
        if self.writer:
            self._lock = _WriterLock(self.directory / ".epochs.lock",
                                     f"another Checkpointer already writes to {self.directory} (in this or another "
                                     f"process); give each its own directory, or close() the other first")
        self._best: Optional[ScoredCheckpointer] = None
        try:
            if best is not None:
                self._best = ScoredCheckpointer(self.directory, score=best, name="best", writer=self.writer)
        except ConfigError:
            if self._lock is not None:
                self._lock.release()
            raise
        if self.writer:
            for stale in self.directory.glob(".epoch-*.tmp"):  # left by a process killed mid-save
                stale.unlink(missing_ok=True)
        self._last_saved_epoch: Optional[int] = None

    @property
    def best(self) -> Optional[Score]:
        return None if self._best is None else self._best.score

    def close(self) -> None:
        """Release the directory (another Checkpointer may then write there)."""
        best, lock = getattr(self, "_best", None), getattr(self, "_lock", None)  # None if __init__ failed early
        if best is not None:
            best.close()
        if lock is not None:
            lock.release()

    def __del__(self) -> None:
        self.close()

    # --- saving -------------------------------------------------------------------------------------------------------
    def maybe_save(self, opt: Any, model: torch.nn.Module, *, metrics: Optional[Metrics] = None,
                   extra: Optional[Dict[str, Any]] = None) -> Optional[Path]:
        """Save if the optimizer reached a new epoch that is a multiple of ``every_epochs``; returns the path."""
        epoch = opt.local_epoch
        if epoch == self._last_saved_epoch or epoch % self.every_epochs or not (self.writer and _saves(opt)):
            return None
        return self.save(opt, model, metrics=metrics, extra=extra)

    def save(self, opt: Any, model: torch.nn.Module, *, metrics: Optional[Metrics] = None,
             extra: Optional[Dict[str, Any]] = None) -> Optional[Path]:
        """Write the training state now; returns the path, or None in a process that does not write (``writer``:
        rank 0 writes). A write that fails (disk full, read-only directory, I/O error) raises
        ``CheckpointWriteError`` and changes nothing on disk; training may go on, and the next save tries again."""
        if not (self.writer and _saves(opt)):
            return None
        state = _training_state(opt, model, metrics, extra)
        path = self.directory / f"epoch-{opt.local_epoch:08d}.pt"
        self._last_saved_epoch = opt.local_epoch  # a failed attempt too: maybe_save does not retry it every step
        if self.keep_last:
            _atomic_save(state, path, intact=self.latest())
        if self._best is not None:
            self._best.consider(state)
        self._prune()
        return path if self.keep_last else self.directory / "best.pt"

    def _prune(self) -> None:
        """Delete the numbered checkpoints beyond ``keep_last``. One that cannot be deleted (the directory turned
        read-only after the new checkpoint was written) stays, said in one line, until a later save deletes it:
        the save itself succeeded."""
        for old in self.checkpoints()[:-self.keep_last] if self.keep_last else self.checkpoints():
            try:
                old.unlink(missing_ok=True)
            except OSError as e:
                logger.warning(f"Could not delete the old checkpoint {old} ({e.strerror or e}); it is kept until a "
                               f"later save deletes it")
                return

    # --- loading ------------------------------------------------------------------------------------------------------
    def checkpoints(self) -> List[Path]:
        """Numbered checkpoints, oldest first."""
        return sorted(p for p in self.directory.iterdir() if _NAME.match(p.name))

    def latest(self) -> Optional[Path]:
        found = self.checkpoints()
        return found[-1] if found else None

    def restore(self, opt: Any, model: torch.nn.Module, path: Optional[os.PathLike | str] = None, *,
                schemas: Sequence[str] = ()) -> Optional[dict]:
        """Load ``path`` (default: the latest checkpoint) into the model and optimizer. Returns the checkpoint's
        ``{"epoch", "metrics", "extra"}``, or None if there is none. If the swarm has moved on meanwhile, the
        optimizer catches up with it as it loads (``Optimizer.load_state_dict``), as any peer that fell behind
        does. Besides the optimizer's ``model_schema`` and ``legacy_schemas`` (this model under an older release),
        ``schemas`` are accepted too (what an older release gave a caller's own identity)."""
        return _restore(opt, model, Path(path) if path is not None else self.latest(), schemas)


def load_checkpoint(path: os.PathLike | str, *, expected_schema: Union[str, Sequence[str], None] = None) -> dict:
    """Read and validate a checkpoint written by ``Checkpointer``; ``expected_schema``: the model schema (or any of
    several) it must have been saved with."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise IncompatibleStateError(f"{path} is not a readable swarm_opt checkpoint: {e}") from e
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise IncompatibleStateError(f"{path} is not a swarm_opt checkpoint (format {_FORMAT})")
    missing = {"model_schema", "epoch", "model", "optimizer"} - set(state)
    if missing:
        raise IncompatibleStateError(f"{path} lacks {sorted(missing)}")
    if isinstance(expected_schema, str):
        expected_schema = (expected_schema,)
    if expected_schema is not None and state["model_schema"] not in expected_schema:
        raise IncompatibleStateError(
            f"{path} holds a different model or strategy (parameter shapes/dtypes differ); load it into the model "
            f"it was saved from, or start a fresh checkpoint directory"
        )
    state.setdefault("metrics", {})
    state.setdefault("extra", {})
    return state


#: what to do about the operating system errors a checkpoint write meets
_REMEDIES = {
    errno.ENOSPC: "free space on that disk or checkpoint to another one",
    errno.EDQUOT: "raise the disk quota or checkpoint to another disk",
    errno.EFBIG: "the file is larger than this process may write (ulimit -f) or the file system allows",
    errno.EROFS: "the file system is mounted read-only: remount it read-write or checkpoint elsewhere",
    errno.EACCES: "this user may not write there: fix the directory's permissions or checkpoint elsewhere",
    errno.EPERM: "this user may not write there: fix the directory's permissions or checkpoint elsewhere",
    errno.EIO: "the disk reported an I/O error: check it, and checkpoint elsewhere meanwhile",
}


def _os_error(error: BaseException) -> Optional[OSError]:
    """The operating system's error behind ``error``: torch.save reports a failed write as a RuntimeError of its
    zip writer, with the OSError as its context."""
    seen = 0
    current: Optional[BaseException] = error
    while current is not None and seen < 8:
        if isinstance(current, OSError) and current.errno is not None:
            return current
        current, seen = current.__cause__ or current.__context__, seen + 1
    return None


def _write_error(what: str, cause: OSError, intact: Optional[Path] = None) -> CheckpointWriteError:
    """One line: what could not be written, why, the fix, and (``intact``) the newest checkpoint still there."""
    code = errno.errorcode.get(cause.errno or 0, str(cause.errno))
    remedy = _REMEDIES.get(cause.errno or 0, "checkpoint elsewhere")
    kept = f"; the previous checkpoint {intact} is intact" if intact is not None else ""
    error = CheckpointWriteError(f"{what}: {cause.strerror or cause} ({code}); {remedy}{kept}")
    error.errno = cause.errno
    return error


def _atomic_save(state: dict, path: Path, intact: Optional[Path] = None) -> None:
    """Write ``state`` to ``path`` or leave everything as it was: a write that fails (disk full, read-only, I/O
    error) removes its temporary file and raises ``CheckpointWriteError`` naming ``intact``, the newest checkpoint
    still there."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
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
    except (OSError, RuntimeError) as e:
        cause = _os_error(e)
        if cause is None:
            raise
        raise _write_error(f"could not write checkpoint {path}", cause, intact) from e
