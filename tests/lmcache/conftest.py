"""Fixtures of the LMCache tests: ``io``, both of fstier's I/O paths."""

from __future__ import annotations

import os

import pytest

from fstier.errors import ConfigError
from fstier.io import native


@pytest.fixture(params=["on", "off"])
def io(request: pytest.FixtureRequest) -> str:
    """The adapter's ``native_io``: the native extension, then the Python
    path (``FSTIER_NATIVE=0`` forces the Python path: "on" skips there)."""
    if request.param == "on":
        if os.environ.get("FSTIER_NATIVE") == "0":
            pytest.skip("FSTIER_NATIVE=0 forces the Python I/O path")
        try:
            native.native_backend()
        except ConfigError:
            if os.environ.get("FSTIER_NATIVE") == "1":
                raise
            pytest.skip("native extension not built")
    return str(request.param)
