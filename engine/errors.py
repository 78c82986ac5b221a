"""Errors a user can hit. Each carries a `user_message` that says what happened and what to do;
the CLI prints it on one line (exit code 2 for a UsageError, 1 for the others) and the app shows
it in a banner as it is.

Internal invariants use `assert`; only conditions a user can cause or fix raise these.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class. `user_message` is complete, plain English, shown as-is."""

    def __init__(self, user_message: str) -> None:
        super().__init__(user_message)
        self.user_message = user_message


class ModelNotFound(EngineError):
    """A model path or id that does not exist."""


class UnsupportedModel(EngineError):
    """A model that exists but cannot be used: bad config, unknown architecture, corrupt file,
    pickle checkpoint, or a draft whose tokenizer does not match the target's."""


class InvalidRequest(EngineError):
    """Settings or prompts that cannot be honoured (budget < 1, empty prompt, ...)."""


class MalformedInput(InvalidRequest):
    """Data from outside SpecChat that is not what it should be: a request body, a server's
    answer or a file another program wrote that is not JSON, nests too deep, is too large, or is
    a folder, FIFO or device where a regular file belongs (engine.untrusted)."""


class UsageError(InvalidRequest):
    """A command line that cannot run as given: an option value or a combination of options
    refused before (or, where only the model can tell, right after) loading. The CLI exits 2
    for these, as for a mistyped option; every other EngineError is a runtime failure (1)."""


class ContextTooLong(InvalidRequest):
    """A prompt that does not fit in the model's context (the API answers 413 for it)."""


class OutOfMemory(EngineError):
    """A pass or a load did not fit in GPU or host memory."""


class DownloadFailed(EngineError):
    """A download that could not complete after retries."""


class ChecksumMismatch(DownloadFailed):
    """A downloaded file whose SHA-256 does not match the hub's metadata."""


class DiskFull(EngineError):
    """Not enough free disk space for a download or import."""


class NotWritable(EngineError):
    """A folder SpecChat must write to (models, data, cache) is read-only or not ours."""


class Cancelled(EngineError):
    """The user cancelled the operation."""


class GatedRepo(DownloadFailed):
    """The hub answered 401/403: the repo is gated (licence not accepted) or the token is missing
    or wrong."""


class HubUnreachable(DownloadFailed):
    """The Hugging Face hub could not be reached at all (no connection, DNS, firewall)."""


class RemoteError(EngineError):
    """An OpenAI-compatible server (vLLM, llama.cpp, another SpecChat) failed a request."""


class RemoteUnreachable(RemoteError):
    """No answer at the server's address (nothing listening, DNS, firewall, timeout)."""


class RemoteUnauthorized(RemoteError):
    """The server answered 401/403: its API key is missing or wrong."""


class RemoteModelGone(RemoteError):
    """The server no longer serves the model a conversation uses (404 for the model)."""


class RemoteDisconnected(RemoteError):
    """The server went away in the middle of an answer (the part that came is kept)."""
