"""FsTier's parts, one concept per module; :mod:`fstier.manager` (``FsTier``)
composes them and is the tier's face.

- :mod:`~fstier.tier.records`: the public records (``JobResult``, events);
- :mod:`~fstier.tier.checks`: what a caller must hand FsTier (keys of the
  model's groups, one held slot per key, slots big enough, timeouts);
- :mod:`~fstier.tier.jobs`: a job in flight (the record, the table, its ops
  on the I/O threads through the block store);
- :mod:`~fstier.tier.outcomes`: judging a finished job (the success and
  failure tables, the verdict);
- :mod:`~fstier.tier.admission`: breaker, write budget, whether a job runs
  now, what a failure means (``POLICY``);
- :mod:`~fstier.tier.fences`: slots of timed-out ops, fenced until the call
  returns;
- :mod:`~fstier.tier.lookup`: presence answers, cached and probed;
- :mod:`~fstier.tier.recency`: hits batched into files' mtimes;
- :mod:`~fstier.tier.capacity`: the usage count and the capacity thread;
- :mod:`~fstier.tier.gc`: the streaming usage scan, LRU eviction and
  the temp sweep (``collect_garbage``, shared with ``fstier gc``);
- :mod:`~fstier.tier.scan`: the streaming walk of a root and what
  ``inspect_root`` reports (shared with ``fstier inspect``);
- :mod:`~fstier.tier.verify`: ``verify_root``, every block file checked the
  way a load checks it, bad ones optionally removed (``fstier verify``);
- :mod:`~fstier.tier.usage`: root-wide usage shared by every instance on a
  root (one count file per instance, an eviction lease);
- :mod:`~fstier.tier.metrics`: counters and histograms, optionally exposed to
  Prometheus;
- :mod:`~fstier.tier.private_pool`: the slots ``FsTier.from_config`` makes
  when it is given none.

Rules: nothing here imports an engine, the CLI, torch or numpy; files are
reached only through the storage layer (:mod:`fstier.io`), block I/O only
through :class:`fstier.io.blockstore.BlockStore`.
"""
