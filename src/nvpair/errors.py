"""nvpair's errors: every exception nvpair raises on purpose, and where each is defined.

NvpairError                      base of every error nvpair raises on purpose
 +-- InputError                  bad user input: one line, names the file and the path in it
 |    +-- ConfigError            nvpair.toml (or the embedded default)
 |    +-- ManifestError          engines/<kind>.json or a manifest path
 +-- ProbeError                  one probe request failed (a state, never a crash)
 +-- ExchangeError               answer: no usable answer on a probe's own connection
 +-- BodyTooLarge                a request body past the cap (asgi.read_body; the 413)
 +-- StartError                  lifecycle: a managed engine could not be started
 +-- StateFileError              orphans: a state file nvpair did not write
 +-- OrphanStuck                 orphans: a process outlived SIGKILL (stuck in the kernel)
 +-- BadRequest                  router.relay: a body the router cannot route (the 400)
 +-- EngineGone                  router.relay: an engine's answer stopped (cut, silent)
 +-- QueueFull                   router.activation: an on-demand engine's queue is full (429)
 +-- Unavailable                 router.activation: a queued request cannot be served (503)
 +-- MemorySourceError           memproc: a memory source cannot be read (a process gone)
 +-- SleepError                  supervision.sleeper: a sleep or wake call to an engine failed
 +-- AdvertRejected              peers.advert: a body that is not an advert this node takes
 +-- Full                        events: max_streams event streams are open (the 503)
 +-- Unreachable                 peers.etcd: etcd did not answer
 +-- EtcdError                   peers.gateway: etcd answered with an error
      +-- BadAnswer              an answer that is not etcd's (a proxy's page, a wrong port)
      +-- LeaseNotFound          the lease expired or was revoked
      +-- WatchCanceled          etcd ended the watch (compaction): range, then watch again

CommandError (a ValueError)      a command template with a placeholder nothing fills

The classes down to BodyTooLarge, and CommandError, are defined here; the others beside
the one module that raises them. ``nvpair.base.boundary`` treats an ``NvpairError`` as an
expected failure (one line in the log) and anything else as a bug (a traceback), so an
error nvpair raises on purpose belongs in this tree. ``CommandError`` is the one exception
outside it, on purpose: the config check turns each one into a ``ConfigError`` before
anything runs, so one raised later means that check missed a case, a bug in nvpair,
reported with its traceback.
tests/test_errors.py checks that every exception class in the package (the simulators
apart) is named here and is an ``NvpairError``, ``CommandError`` excepted.
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


class CommandError(ValueError):
    """A command or ``start.argv``/``start.env`` template that cannot be filled. Not an
    ``NvpairError``: the config check turns it into a ``ConfigError``; raised later, a bug."""


class ProbeError(NvpairError):
    """A probe got no usable answer. ``kind`` says how: refused, timeout, status, body, error."""

    def __init__(self, kind: str, message: str, *, http_status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.http_status = http_status


class BodyTooLarge(NvpairError):
    """A request body longer than the handler accepts (answered 413)."""
