"""fstier's own Prometheus exporter for the engine integrations whose engine
does not put fstier's metrics on its endpoint (SGLang's
``--hicache-storage-backend-extra-config``, LMCache's ``adapter_params``):
their opt-in ``metrics_port`` option.

Invariants:

* **One HTTP server per process**, started by the first integration that
  asks (:func:`serve_metrics`) and kept for the life of the process (a
  daemon thread). Asking again for the same port shares it; asking for
  another port is one :class:`~fstier.errors.ConfigError` naming both, and
  so is a port that cannot be listened on (another process has it).
* **Every tier of the process on one page, never colliding**: one registry,
  one collector (:func:`fstier.tier.metrics.tiers_collector`); each
  metric name is one family, with one sample per exported tier labelled
  ``fstier_namespace`` (the tier's namespace; ``#2``, ``#3`` ... for a
  second open tier of one namespace). The ``fstier_*`` names are those of
  ``FsTier.metrics.start_prometheus_exporter``, so the dashboard's second
  row and the alert rules read either.
* A tier is on the page from :func:`export_tier` until :func:`unexport_tier`
  (an integration calls it when it closes a tier it may reopen); a tier
  never exported costs nothing.

Costs: nothing on any hot path; a scrape reads every exported tier's
metrics (tens of microseconds a tier), under this module's lock.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from fstier.config_file import shown
from fstier.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from fstier.manager import FsTier
    from fstier.tier.metrics import TierMetrics

__all__ = ["METRICS_LABEL", "check_metrics_port", "export_tier", "exported_port", "serve_metrics", "unexport_tier"]

#: The label that tells the tiers of one process apart on the page.
METRICS_LABEL = "fstier_namespace"

_lock = threading.Lock()
_port: int | None = None
#: label value -> the metrics of one exported tier, in the order exported
_tiers: dict[str, TierMetrics] = {}


def check_metrics_port(value: object, who: str, doc: str) -> int | None:
    """``metrics_port`` as given (None: not asked for), or one
    :class:`ConfigError` naming it: a TCP port, an integer 1..65535."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ConfigError(
            f"{who} option 'metrics_port': expected a TCP port (an integer 1..65535) to serve fstier's "
            f"Prometheus metrics on, got {shown(value)}; see {doc}"
        )
    return value


def serve_metrics(port: int | None, who: str) -> int | None:
    """Start this process's exporter on ``port`` (all addresses), once; None
    does nothing. Returns ``port``. Raises :class:`ConfigError` when the
    process already serves another port or ``port`` cannot be listened on,
    and :class:`~fstier.errors.MetricsUnavailableError` without
    ``prometheus-client``."""
    global _port
    if port is None:
        return None
    with _lock:
        if _port is not None:
            if _port != port:
                raise ConfigError(
                    f"{who} option 'metrics_port' {port}: this process already serves fstier's metrics on "
                    f"port {_port}; give every fstier integration in one process the same metrics_port"
                )
            return port
        from fstier.tier.metrics import serve_collector, tiers_collector

        try:
            serve_collector(tiers_collector(_listed, (METRICS_LABEL,)), port)
        except OSError as exc:
            raise ConfigError(
                f"{who} option 'metrics_port' {port}: cannot listen there ({exc.strerror or exc}); "
                "give a port no other process uses"
            ) from None
        _port = port
        return port


def _listed() -> list[tuple[tuple[str, ...], TierMetrics]]:
    with _lock:
        return [((label,), metrics) for label, metrics in _tiers.items()]


def export_tier(tier: FsTier, port: int | None) -> None:
    """Put ``tier`` on the page of the exporter :func:`serve_metrics` started
    on ``port``; None (``metrics_port`` not given) does nothing."""
    if port is None:
        return
    with _lock:
        if any(m is tier.metrics for m in _tiers.values()):
            return
        label, n = tier.mapper.namespace, 1
        while label in _tiers:
            n += 1
            label = f"{tier.mapper.namespace}#{n}"
        _tiers[label] = tier.metrics


def unexport_tier(tier: FsTier) -> None:
    """Take ``tier`` off the page (its series end); not exported: nothing."""
    with _lock:
        for label, metrics in list(_tiers.items()):
            if metrics is tier.metrics:
                del _tiers[label]


def exported_port() -> int | None:
    """The port this process serves fstier's metrics on, or None."""
    return _port
