"""The error tree. Every error dora raises on purpose is a `DoraError`, so callers can catch ours
only.

Errors are caught only where a policy exists (STYLE.md): a tool exception becomes a tool message, a
failed episode becomes a marked sample, a network call gets bounded retries. Everything else
propagates.
"""

from __future__ import annotations


class DoraError(Exception):
    """Base of every error dora raises on purpose."""


class ConfigError(DoraError):
    """A setting is unknown, has the wrong type or value, or contradicts another setting."""


class ChatTemplateMissing(ConfigError):
    """The environment gives chat messages, but the model's tokenizer has no chat template."""


class ProtocolError(DoraError):
    """A message on the wire is malformed or arrives out of order."""


class ServerError(DoraError):
    """An inference server or another endpoint failed."""


class ServerTimeout(ServerError):
    """An endpoint did not answer in time; the message says what we were waiting for."""


class ServerUnavailable(ServerError):
    """An endpoint is not reachable or is shutting down."""


class RequestError(ServerError):
    """The server refused a request as malformed (HTTP 4xx); retrying will not help."""


class VersionMismatch(ServerError):
    """A request was pinned to a version the instance does not hold (C1 would break)."""


class RunAborted(DoraError):
    """The run cannot go on, and a restart would meet the same cause (the same data, the same
    weights): `dora run` does not restart a side that exits with `exit_code` for it."""

    exit_code = 4


class RunDirError(RunAborted):
    """The run directory cannot be used as it is: another run owns it, a resume would change a
    setting that defines the run, or what a resume needs (its journal, its last checkpoint, its
    config) is missing or cut short. A restart would meet the same directory."""


class EnvError(DoraError):
    """An environment failed: a bad task, a reward that raised, or an episode that could not
    finish."""


class AllMasked(EnvError, RunAborted):
    """Every sample of a step was masked: training on it would learn nothing."""


class DataError(DoraError):
    """A dataset row is malformed; the message names the file and the row."""


class TrainingError(RunAborted):
    """The trainer met a value it must not train on (a non-finite loss or gradient norm); the
    message says what, at which step, and where it came from."""


class SchedulingError(DoraError):
    """The scheduling core was asked for something its invariants forbid."""
