"""FsTier jobs for a caller that waits inside its call.

FsTier's jobs are asynchronous (submit, then collect results with
``get_finished``). An engine whose storage calls are synchronous (SGLang's
prefetch and backup threads block in them) runs each call as one job here:
:meth:`BlockingJobs.run` submits it and polls ``get_finished`` with 0.2 to
2 ms sleeps until its result is in; results of other threads' jobs, collected
by whichever thread polled, are kept for them under one lock. Such a caller
publishes no tier events: they are taken and dropped at each poll, so the
tier's list never grows.

The tier should be built with ``hold_fenced_results=True`` when the engine
reuses rows as soon as a call returns: a job whose row a timed-out call may
still touch is then reported, and its call returns, only once that call did.
A job FsTier refuses at submission (a bad slot, a closed tier) is ``None``,
never an exception.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fstier.errors import FstierError

if TYPE_CHECKING:  # pragma: no cover
    from fstier.keys import BlockKey
    from fstier.manager import FsTier, JobResult

__all__ = ["BlockingJobs"]

_POLL_MIN_S = 0.0002
_POLL_MAX_S = 0.002


class BlockingJobs:
    """Run FsTier jobs to completion, one per call, from any thread."""

    def __init__(self, tier: FsTier, engine: str) -> None:
        self.tier = tier
        self.engine = engine
        #: the engine adapter's own logger (``fstier.sglang`` for SGLang)
        self.log = logging.getLogger(f"fstier.{engine.lower()}")
        self._results: dict[Any, JobResult] = {}
        self._results_lock = threading.Lock()
        self._ids = itertools.count()

    def run(self, kind: str, bkeys: list[BlockKey], slots: Sequence[int]) -> JobResult | None:
        """Submit one job (``kind`` "store" or "load") and wait for its
        result (None if refused)."""
        tier = self.tier
        job_id = (self.engine.lower(), kind, next(self._ids))
        try:
            if kind == "store":
                tier.submit_store(job_id, bkeys, slots)
            else:
                tier.submit_load(job_id, bkeys, slots)
        except (ValueError, FstierError) as exc:
            self.log.error("fstier: %s %s of %d file(s) refused: %s", self.engine, kind, len(bkeys), exc)
            return None
        delay = _POLL_MIN_S
        while True:
            with self._results_lock:
                for r in tier.get_finished():
                    self._results[r.job_id] = r
                # Events are not published: take them so the tier's list never grows.
                tier.take_events()
                result = self._results.pop(job_id, None)
            if result is not None:
                break
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        if result.cause and not result.success:
            self.log.warning(
                "fstier: %s %s: %d of %d file(s) done (%s)",
                self.engine, kind, result.keys_completed, len(bkeys), result.cause,
            )
        return result
