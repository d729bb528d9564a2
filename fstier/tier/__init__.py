"""FsTier's parts, one concept per module; :mod:`fstier.manager` (``FsTier``)
composes them and is the tier's face.

- :mod:`~fstier.tier.checks`: what a caller must hand FsTier (keys of the
  model's groups, one held slot per key);
- :mod:`~fstier.tier.gc`: the streaming usage scan, LRU eviction and
  the temp sweep (``collect_garbage``, shared with ``fstier gc``);
- :mod:`~fstier.tier.usage`: root-wide usage shared by every instance on a
  root (a ``flock``-guarded byte count, one evicting instance at a time);
- :mod:`~fstier.tier.metrics`: counters and histograms, optionally exposed to
  Prometheus.

Rules: nothing here imports an engine, the CLI, torch or numpy; files are
reached only through the storage layer (:mod:`fstier.io`).
"""
