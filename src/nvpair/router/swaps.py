"""When a loaded on-demand engine may be evicted for another that requests wait for: swap
batching, a pure rule (no trio, no I/O; time is an argument).

Two models that share memory for one, with requests alternating between them, would
otherwise swap on nearly every request: each swap is a load of seconds to minutes. The rule
(docs/on-demand.md, "Swaps that do not thrash"): a loaded engine that still has work of its
own (requests in flight, or waiting for it) keeps serving until it has served
``swap_batch`` routed requests since it was loaded and has been loaded ``min_residency_s``;
then it may be evicted. A request waiting for the other engine that has waited
``max_swap_wait_s`` ends the hold at once (the longest a swap is put off). An engine with
no work of its own is never held. ``swap_batch = 0`` and ``min_residency_s = 0`` (the
defaults) hold nothing: every eviction goes ahead as soon as it is planned.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SwapPolicy:
    """The ``[activation]`` settings of the rule."""

    swap_batch: int = 0
    min_residency_s: float = 0.0
    max_swap_wait_s: float = 60.0

    @property
    def holds(self) -> bool:
        """The rule can hold an eviction at all."""
        return self.swap_batch > 0 or self.min_residency_s > 0


@dataclass(frozen=True)
class Resident:
    """A loaded engine that a plan would evict."""

    name: str
    #: when it was loaded (became ready for requests)
    since: float
    #: routed requests started on it since
    served: int
    #: requests in flight on it, or waiting for it
    busy: bool


@dataclass(frozen=True)
class Verdict:
    """``evict``: it may go now; ``why`` in words either way; held: ``until``, the time the
    hold ends by itself at the latest (more served requests, or the end of its work, may end
    it sooner)."""

    evict: bool
    why: str
    until: float | None = None


def _s(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


def verdict(policy: SwapPolicy, victim: Resident, waiting: str, waited_s: float,
            now: float) -> Verdict:
    """May ``victim`` be evicted now for engine ``waiting``, whose oldest request has
    waited ``waited_s``?"""
    resident = max(now - victim.since, 0.0)
    if not policy.holds:
        return Verdict(True, "no swap batching (swap_batch 0, min_residency_s 0)")
    if not victim.busy:
        return Verdict(True, f"{victim.name} had nothing in flight or waiting "
                             f"(served {victim.served})")
    if waited_s >= policy.max_swap_wait_s:
        return Verdict(True, f"{waiting} waited {_s(waited_s)} >= max_swap_wait_s "
                             f"{policy.max_swap_wait_s:g} s (served {victim.served})")
    batch_done = victim.served >= policy.swap_batch
    stayed = resident >= policy.min_residency_s
    if batch_done and stayed:
        if policy.swap_batch and policy.min_residency_s:
            why = (f"served {victim.served} of swap_batch {policy.swap_batch}, loaded "
                   f"{_s(resident)} of min_residency_s {policy.min_residency_s:g} s")
        elif policy.swap_batch:
            why = f"served {victim.served} of swap_batch {policy.swap_batch}"
        else:
            why = (f"loaded {_s(resident)} of min_residency_s {policy.min_residency_s:g} s"
                   f" (served {victim.served})")
        return Verdict(True, why)
    until = now + (policy.max_swap_wait_s - waited_s)
    if batch_done:  # (only the residency holds it: it ends at a known time)
        until = min(until, victim.since + policy.min_residency_s)
    left = []
    if not batch_done:
        left.append(f"served {victim.served} of swap_batch {policy.swap_batch}")
    if not stayed:
        left.append(f"loaded {_s(resident)} of min_residency_s {policy.min_residency_s:g} s")
    return Verdict(False, f"{victim.name} keeps serving ({', '.join(left)}); {waiting} "
                          f"waited {_s(waited_s)} of max_swap_wait_s "
                          f"{policy.max_swap_wait_s:g} s", until)
