"""nvpair's errors.

NvpairError                      base of every error nvpair raises on purpose
 +-- InputError                  bad user input: one line, names the file and the path in it
 |    +-- ConfigError            nvpair.toml (or the embedded default)
 |    +-- ManifestError          engines/<kind>.json or a manifest path
 +-- ProbeError                  one probe request failed (a state, never a crash)
"""

from __future__ import annotations


class NvpairError(Exception):
    """Base class of nvpair's own errors."""


class InputError(NvpairError):
    """Bad input that the user must fix; the message is one line."""


class ConfigError(InputError):
    """The configuration file is wrong."""


class ManifestError(InputError):
    """An engine manifest is wrong."""


class ProbeError(NvpairError):
    """A probe got no usable answer. ``kind`` says how: refused, timeout, status, body, error."""

    def __init__(self, kind: str, message: str, *, http_status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.http_status = http_status
