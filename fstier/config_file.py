"""Reading a configuration document: bounded, never blocking, one error.

Every reader of a config file goes through here: :func:`fstier.load_config`,
``fstier config validate|show`` and an engine's ``config`` option. Whatever
the file is, the result is a parsed document or one
:class:`~fstier.errors.ConfigError` line naming the file (and, where there
is one, the field, line and column), never a traceback or a hang:

- **Regular files only.** The file is opened ``O_NONBLOCK`` (a FIFO with no
  writer cannot block the open) and ``fstat``-ed: a FIFO, socket, device
  (``/dev/zero``) or directory is refused before a byte is read. Symlinks
  to a regular file are followed (config maps are often links).
- **Bounded size.** At most :data:`MAX_CONFIG_BYTES` are read, from a file
  or from stdin (``-``); a longer document is refused.
- **Bounded structure.** Nesting deeper than :data:`MAX_CONFIG_DEPTH`
  (checked on the YAML events or JSON brackets *before* the recursive
  parsers run, and again on the parsed value, so a recursive YAML alias is
  refused too), more than :data:`MAX_CONFIG_NODES` values after alias
  expansion, an integer of more than :data:`MAX_INT_DIGITS` digits or a
  string (key or value) of more than :data:`MAX_STRING_CHARS` characters is
  refused with the path of the value that broke the limit.
- **Values cut in messages.** :func:`shown` is every message's view of a
  value: its ``repr`` cut to :data:`SHOWN_CHARS` characters with the length
  said, so no message echoes a megabyte back.

Costs: one ``open``/``fstat``/``read`` and one event pass over the YAML
before it is loaded (a config is a few hundred bytes; the cap bounds the
worst case). Pinned by tests/test_config_hostile.py.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from typing import IO, Any

import yaml

from fstier.errors import ConfigError

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_NODES",
    "MAX_INT_DIGITS",
    "MAX_STRING_CHARS",
    "SHOWN_CHARS",
    "check_limits",
    "cut",
    "json_document",
    "read_config_stream",
    "read_config_text",
    "shown",
    "yaml_document",
]

#: Largest config document read (bytes): real ones are under 4 KiB.
MAX_CONFIG_BYTES = 1 << 20
#: Deepest nesting of mappings and lists (fstier's documents need 5).
MAX_CONFIG_DEPTH = 32
#: Most values in one document, YAML aliases expanded.
MAX_CONFIG_NODES = 10_000
#: Most digits of an integer (``max_bytes`` up to 2^63 has 19).
MAX_INT_DIGITS = 40
#: Longest string, key or value (PATH_MAX).
MAX_STRING_CHARS = 4096
#: Characters of a value a message shows.
SHOWN_CHARS = 80

_SafeLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def cut(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` cut to ``limit`` characters; the cut says how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for a message, cut to ``limit`` characters."""
    if isinstance(value, str | bytes) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value):,} characters)"
    return cut(repr(value), limit)


def _read_capped(read: Any, source: str) -> bytes:
    chunks: list[bytes] = []
    left = MAX_CONFIG_BYTES + 1
    while left > 0:
        chunk = read(min(left, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    if left <= 0:
        raise ConfigError(
            f"{source}: more than {MAX_CONFIG_BYTES:,} bytes; a config file is a few KiB "
            "(is this the right file?)"
        )
    return b"".join(chunks)


def _decode(raw: bytes, source: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None


def read_config_text(path: str | os.PathLike[str], what: str = "config file") -> str:
    """The text of the config file ``path`` (see the module docstring);
    errors read ``<what> '<path>': <problem>``."""
    name = f"{what} {shown(os.fspath(path), 256)}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        raise ConfigError(f"{name}: not found") from None
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a socket
            raise ConfigError(f"{name}: not a regular file (a socket); give a YAML file") from None
        raise ConfigError(f"{name}: cannot read: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{name}: is a directory, expected a YAML file")
        if not stat.S_ISREG(st.st_mode):
            kind = (
                "a FIFO"
                if stat.S_ISFIFO(st.st_mode)
                else "a device"
                if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "a socket"
            )
            raise ConfigError(f"{name}: not a regular file ({kind}); give a YAML file, or '-' to read stdin")
        if st.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"{name}: {st.st_size:,} bytes, more than the {MAX_CONFIG_BYTES:,} a config file may "
                "hold (is this the right file?)"
            )
        try:
            raw = _read_capped(lambda n: os.read(fd, n), name)
        except OSError as exc:
            raise ConfigError(f"{name}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    return _decode(raw, name)


def read_config_stream(stream: IO[bytes], source: str = "<stdin>") -> str:
    """The text of a binary stream (stdin for ``-``), at most
    :data:`MAX_CONFIG_BYTES`; waits for its writer like any reader of a pipe."""
    try:
        raw = _read_capped(stream.read, source)
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror or exc}") from None
    return _decode(raw, source)


# ------------------------------------------------------------------ limits
def _where(path: list[object]) -> str:
    """``tier.groups[0].name`` for a path of keys and indices (keys cut)."""
    out = ""
    for p in path:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            key = p if isinstance(p, str) and len(p) <= 64 else shown(p, 32)
            out += f".{key}" if out else key
    return out or "<top>"


def _limit_error(source: str, path: list[object], what: str) -> ConfigError:
    return ConfigError(f"{source}: {_where(path)}: {what}")


def check_limits(data: Any, source: str) -> Any:
    """``data`` (a parsed document) if it is within the limits, else one
    :class:`ConfigError` naming the first value that is not. Iterative, so a
    recursive structure (a YAML alias of its own parent) cannot recurse."""
    nodes = 0
    stack: list[tuple[Any, list[object]]] = [(data, [])]
    while stack:
        value, path = stack.pop()
        nodes += 1
        if nodes > MAX_CONFIG_NODES:
            raise ConfigError(
                f"{source}: more than {MAX_CONFIG_NODES:,} values (YAML aliases expanded); a config has a few dozen"
            )
        if len(path) > MAX_CONFIG_DEPTH:
            raise _limit_error(source, path[:MAX_CONFIG_DEPTH], f"nested deeper than {MAX_CONFIG_DEPTH} levels")
        if isinstance(value, str) and len(value) > MAX_STRING_CHARS:
            raise _limit_error(
                source, path, f"a string of {len(value):,} characters; a value holds at most {MAX_STRING_CHARS:,}"
            )
        if isinstance(value, int) and abs(value) >= 10**MAX_INT_DIGITS:
            raise _limit_error(source, path, f"an integer of more than {MAX_INT_DIGITS} digits")
        if isinstance(value, dict):
            for k, v in value.items():
                if isinstance(k, str) and len(k) > MAX_STRING_CHARS:
                    raise _limit_error(
                        source, path, f"a key of {len(k):,} characters; a key holds at most {MAX_STRING_CHARS:,}"
                    )
                stack.append((v, [*path, k]))
        elif isinstance(value, list):
            stack.extend((v, [*path, i]) for i, v in enumerate(value))
    return data


_INT_TAG = "tag:yaml.org,2002:int"
_INT = re.compile(r"^[-+]?(0b[01_]+|0x[0-9a-fA-F_]+|0o?[0-7_]+|[0-9][0-9_]*(:[0-5]?[0-9])*)$")


def _at(event: Any) -> str:
    mark = event.start_mark
    return f"line {mark.line + 1} column {mark.column + 1}" if mark is not None else "an unknown line"


def _yaml_prescan(text: str, source: str) -> None:
    """Depth and integer limits on the YAML events, before the (recursive)
    composer and the integer constructor can fail on them."""
    depth = 0
    for event in yaml.parse(text, Loader=_SafeLoader):
        if isinstance(event, yaml.MappingStartEvent | yaml.SequenceStartEvent):
            depth += 1
            if depth > MAX_CONFIG_DEPTH:
                raise ConfigError(f"{source}: nested deeper than {MAX_CONFIG_DEPTH} levels at {_at(event)}")
        elif isinstance(event, yaml.MappingEndEvent | yaml.SequenceEndEvent):
            depth -= 1
        elif isinstance(event, yaml.ScalarEvent):
            value = event.value
            plain_int = event.implicit[0] and not event.style and _INT.match(value) is not None
            if len(value) > MAX_INT_DIGITS and (plain_int or event.tag == _INT_TAG):
                raise ConfigError(
                    f"{source}: an integer of {len(value):,} digits at {_at(event)}; fstier's "
                    f"integers have at most {MAX_INT_DIGITS}"
                )


def yaml_document(text: str, source: str | os.PathLike[str]) -> Any:
    """Parse YAML ``text`` read from ``source`` within the limits; a syntax
    error is one :class:`ConfigError` naming the file, line and column."""
    src = str(source)
    try:
        _yaml_prescan(text, src)
        data = yaml.load(text, Loader=_SafeLoader)  # noqa: S506 - a safe loader
    except ConfigError:
        raise
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{src}: invalid YAML{where}: {cut(problem, 200)}") from None
    except (ValueError, TypeError, OverflowError) as exc:
        # A scalar YAML's constructors cannot build (a date like 2020-13-45).
        raise ConfigError(f"{src}: invalid YAML value: {cut(str(exc), 200)}") from None
    return check_limits(data, src)


_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


def _json_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ConfigError(f"an integer of {len(text):,} digits; fstier's integers have at most {MAX_INT_DIGITS}")
    return int(text)


def json_document(text: str, source: str) -> Any:
    """Parse JSON ``text`` read from ``source`` within the limits."""
    depth = 0
    for m in _JSON_TOKENS.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > MAX_CONFIG_DEPTH:
                line = text.count("\n", 0, m.start()) + 1
                raise ConfigError(f"{source}: nested deeper than {MAX_CONFIG_DEPTH} levels at line {line}")
        elif c in "]}":
            depth -= 1
    try:
        data = json.loads(text, parse_int=_json_int)
    except ConfigError as exc:  # a ValueError too: first
        raise ConfigError(f"{source}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{source}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{source}: invalid JSON: {cut(str(exc), 200)}") from None
    return check_limits(data, source)
