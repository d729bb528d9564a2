"""FsTier jobs for a caller that waits inside its call.

FsTier's jobs are asynchronous. An engine whose storage calls are
synchronous (SGLang's prefetch and backup threads block in them) runs each
call as one job: :func:`run_job` submits it under the caller's tag (its job
id, unique per call) and waits for that job with :meth:`FsTier.wait
<fstier.manager.FsTier.wait>`, which the engine's completion wakes: no
polling, and no table of other threads' results here (the tier hands each
waiter its own). Such a caller publishes no tier events: they are taken and
dropped after each call, so the tier's list never grows.

The tier should be built with ``hold_fenced_results=True`` when the engine
reuses rows as soon as a call returns: a job whose row a timed-out call may
still touch is then reported, and its call returns, only once that call did.
A job FsTier refuses at submission (a bad slot, a closed tier) is ``None``,
never an exception.

Costs
    Per call: one submit, one wait (a thread wake-up at the job's
    completion), one ``take_events``.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from fstier.errors import FstierError

if TYPE_CHECKING:  # pragma: no cover
    from fstier.keys import BlockKey
    from fstier.manager import FsTier, JobResult

__all__ = ["run_job"]


def run_job(
    tier: FsTier, tag: Hashable, kind: str, bkeys: list[BlockKey], slots: Sequence[int], engine: str,
) -> JobResult | None:
    """Submit one job (``kind`` "store" or "load") as ``tag`` and wait for
    its result; None if refused. Logged on the engine adapter's own logger
    (``fstier.sglang`` for ``engine="SGLang"``)."""
    log = logging.getLogger(f"fstier.{engine.lower()}")
    try:
        if kind == "store":
            tier.submit_store(tag, bkeys, slots)
        else:
            tier.submit_load(tag, bkeys, slots)
        result = tier.wait(tag)
    except (ValueError, FstierError) as exc:
        log.error("fstier: %s %s of %d file(s) refused: %s", engine, kind, len(bkeys), exc)
        return None
    finally:
        tier.take_events()  # events are not published: the tier's list never grows
    if result is not None and result.cause and not result.success:
        log.warning(
            "fstier: %s %s: %d of %d file(s) done (%s)", engine, kind, result.keys_completed, len(bkeys), result.cause
        )
    return result
