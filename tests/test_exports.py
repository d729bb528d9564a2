"""The public surface: every type that a public function takes or returns is
importable from ``fstier`` itself, and a name means one thing."""

from __future__ import annotations

import inspect
import typing

import fstier


def _fstier_classes(hint: object) -> set[type]:
    """Classes defined in fstier that appear anywhere in a type hint."""
    found: set[type] = set()
    stack = [hint]
    while stack:
        h = stack.pop()
        if isinstance(h, type) and h.__module__.startswith("fstier"):
            found.add(h)
        stack.extend(typing.get_args(h))
    return found


def _public_callables() -> list[object]:
    out: list[object] = []
    for name in fstier.__all__:
        obj = getattr(fstier, name)
        if inspect.isfunction(obj):
            out.append(obj)
        elif inspect.isclass(obj) and obj.__module__.startswith("fstier"):
            for attr, member in vars(obj).items():
                if attr.startswith("_") and attr != "__init__":
                    continue
                func = member.__func__ if isinstance(member, classmethod | staticmethod) else member
                if inspect.isfunction(func):
                    out.append(func)
                elif isinstance(member, property) and member.fget is not None:
                    out.append(member.fget)
    return out


def test_every_name_in_all_resolves() -> None:
    for name in fstier.__all__:
        assert getattr(fstier, name) is not None, name


def _names() -> dict[str, object]:
    """Every name the modules behind the public API define or import (type
    hints that are strings under TYPE_CHECKING resolve against these)."""
    import importlib

    ns: dict[str, object] = {}
    for mod in (
        "fstier.tier.metrics",
        "fstier.slots",
        "fstier.slots.host_pool",
        "fstier.layout",
        "fstier.cross_layer",
        "fstier.gpu_copy",
        "fstier.manager",
        "fstier.file_mapper",
        "fstier.config",
        "fstier.keys",
    ):
        ns.update(vars(importlib.import_module(mod)))
    return ns


def test_types_of_public_functions_are_exported() -> None:
    exported = {id(getattr(fstier, n)) for n in fstier.__all__}
    missing: dict[str, str] = {}
    localns = _names()
    for func in _public_callables():
        hints = typing.get_type_hints(func, localns=localns)  # type: ignore[arg-type]
        for hint in hints.values():
            for cls in _fstier_classes(hint):
                if id(cls) not in exported and not cls.__name__.startswith("_"):
                    missing[cls.__name__] = getattr(func, "__qualname__", str(func))
    assert not missing, f"used by public functions but not exported from fstier: {missing}"


def test_layer_kv_spec_is_exported() -> None:
    from fstier.cross_layer import LayerKVSpec

    assert fstier.LayerKVSpec is LayerKVSpec


def test_kv_layout_means_one_thing() -> None:
    """``kv_layout`` is the group's NHD/HND order (a config field, part of the
    namespace); the rank-local K/V arrangement is ``kv_packing``."""
    params = inspect.signature(fstier.rank_page_mapping).parameters
    assert "kv_packing" in params and "kv_layout" not in params
    assert "kv_layout" in fstier.KVGroupSpec.model_fields
    assert typing.get_args(fstier.KVPacking) == ("packed", "split", "interleaved")


def test_errors_an_engine_catches_are_exported() -> None:
    """A closed tier's calls raise TierClosedError and the Prometheus export
    without prometheus-client raises MetricsUnavailableError: both are
    importable from ``fstier`` (they were not)."""
    from fstier import errors

    assert fstier.TierClosedError is errors.TierClosedError
    assert fstier.MetricsUnavailableError is errors.MetricsUnavailableError
    public = {n for n in fstier.__all__ if n.endswith("Error")}
    defined = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, Exception)
               and v.__module__ == "fstier.errors" and not n.startswith("_") and n != "IOPoolClosedError"}
    assert defined <= public, defined - public
