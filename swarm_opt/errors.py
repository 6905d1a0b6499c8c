"""Exceptions raised by swarm_opt. User mistakes are ValueError/TypeError subclasses so that callers can catch them
the usual way; swarm failures (nobody to average with, no donor for the state) have their own type."""

from __future__ import annotations


class SwarmOptError(Exception):
    """Base class of every error swarm_opt raises on purpose."""


class ConfigError(SwarmOptError, ValueError):
    """A user-supplied value is invalid; the message says which one and how to fix it."""


class ConfigTypeError(SwarmOptError, TypeError):
    """A user-supplied object has the wrong type; the message says what was expected."""


class StateDownloadError(SwarmOptError, RuntimeError):
    """No peer could provide a usable training state within the time allowed."""


class IncompatibleStateError(SwarmOptError, ValueError):
    """A state (checkpoint or download) does not fit this model or optimizer."""


class NonFiniteTensorError(SwarmOptError, ValueError):
    """A tensor about to be sent to peers holds NaN or infinite values; sending it would poison their averages."""


class CheckpointWriteError(SwarmOptError, OSError):
    """A checkpoint could not be written (disk full, read-only or forbidden directory, I/O error). Nothing was
    replaced: the checkpoints written before are intact. The message names the cause, the fix and the newest intact
    checkpoint; ``errno`` is the operating system's."""
