"""Child process of the resource-limit tests (run as a script): it changes
its own process-wide state (RLIMIT_NOFILE, uid) without touching pytest's,
runs stores and loads, and prints one JSON document for the parent.

``_child.py emfile ROOT``   stores/loads under a RLIMIT_NOFILE that leaves no
                            free descriptor, then raises it again.
``_child.py asuser ROOT OTHER``  drops to uid/gid 65534 (nobody) and stores,
                            loads and starts a tier where it may not write.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import traceback
from typing import Any

import _support  # the script's directory is on sys.path

from fstier.io.blockstore import NamespaceDirs


def _status(out: Any) -> list[str]:
    return [str(out.status.value), out.cause]


def emfile(root: str) -> dict[str, Any]:
    tier = _support.Tier.open(root)
    good = _support.key_for(0)
    assert tier.store(good).status == "STORED"
    payload = _support.payload_for(good, tier.payload_len)
    fds_before = _support.fd_count()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(x) for x in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1, hard))
    fillers: list[int] = []  # occupy the holes below the limit: no fd is free
    try:
        while True:
            try:
                fillers.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                break
        stores = [_status(tier.store(_support.key_for(i))) for i in range(1, 6)]
        loads = [_status(tier.load(good)[0]) for _ in range(5)]
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    fds_after = _support.fd_count()
    recovered = [_status(tier.store(_support.key_for(i))) for i in range(1, 6)]
    out, got = tier.load(good)
    return {
        "stores": stores,
        "loads": loads,
        "fds_before": fds_before,
        "fds_after": fds_after,
        "recovered": recovered,
        "reload": [*_status(out), got == payload],
        "temps": len(_support.temp_files(_support.Path(root))),
    }


def asuser(root: str, other: str) -> dict[str, Any]:
    tier = _support.Tier.open(root)  # as root: the namespace already exists
    try:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    except OSError as exc:
        return {"skip": f"cannot drop privileges: {exc}"}
    readable, locked = _support.key_for(1), _support.key_for(2)
    try:
        NamespaceDirs(tier.mapper).ensure(tier.path(_support.key_for(4)))
        mkdir = "ok"
    except Exception as exc:
        mkdir = f"{type(exc).__name__}: {exc}"
    out, got = tier.load(readable)
    result: dict[str, Any] = {
        "uid": os.getuid(),
        "mkdir": mkdir,
        "store": _status(tier.store(_support.key_for(3))),
        "load_readable": [*_status(out), got == _support.payload_for(readable, tier.payload_len)],
        "load_locked": _status(tier.load(locked)[0]),
        "temps": len(_support.temp_files(_support.Path(root))),
    }
    try:
        _support.Tier.open(other)
        result["startup"] = "ok"
    except Exception as exc:  # the parent asserts on the type and words
        result["startup"] = f"{type(exc).__name__}: {exc}"
    return result


if __name__ == "__main__":
    try:
        res = emfile(sys.argv[2]) if sys.argv[1] == "emfile" else asuser(sys.argv[2], sys.argv[3])
    except Exception:
        res = {"crash": traceback.format_exc()}
    print(json.dumps(res))
