#!/usr/bin/env bash
# `make test-sharedfs`: install the Debian packages, stand up GlusterFS,
# MooseFS and CephFS (servers + two client hosts in network namespaces), run
# tests/sharedfs on each, and ALWAYS tear everything down: on success, on
# failure, on Ctrl-C or SIGTERM, and on the time limit. Leftovers of an
# earlier run whose driver died (SIGKILL) are removed first; a live run of
# another checkout (its owner pid alive) is left alone.
#
#   tests/sharedfs/run.sh PYTHON [pytest args...]
#
# pytest args naming test files (tests/...) replace the default tests/sharedfs
# (one test: tests/sharedfs/test_capacity_shared.py, or -k NAME); the tests
# import this checkout's fstier (PYTHONPATH).
# Environment: FSTIER_SHAREDFS_TIME_LIMIT (seconds for the tests, default 1500: three filesystems took 628 s at load average 5-10 and ~15 min at 20-26 on a 2-core VM);
# FSTIER_SHAREDFS_FILESYSTEMS (default "glusterfs moosefs cephfs") to stand
# up and test fewer.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
py=${1:?usage: run.sh PYTHON [pytest args...]}
shift
limit=${FSTIER_SHAREDFS_TIME_LIMIT:-1500}

if [[ $(id -u) != 0 ]]; then
    echo "test-sharedfs needs root (network namespaces, loop and FUSE mounts)" >&2
    exit 1
fi
[[ -e /dev/fuse ]] || { echo "test-sharedfs needs /dev/fuse" >&2; exit 1; }

t0=$SECONDS
"$here/sharedfs.sh" install || exit 1
"$here/sharedfs.sh" sweep

dir=/var/tmp/fstier-sharedfs-$$
export FSTIER_SHAREDFS_OWNER=$$
tests_pid=""

cleanup() {
    local rc=$?
    trap - EXIT INT TERM HUP
    if [[ -n $tests_pid ]]; then
        # The tests run in their own process group: end it and its children.
        kill -TERM -- "-$tests_pid" 2>/dev/null
        local end=$((SECONDS + 10))
        while kill -0 -- "-$tests_pid" 2>/dev/null && ((SECONDS < end)); do sleep 0.2; done
        kill -KILL -- "-$tests_pid" 2>/dev/null
    fi
    "$here/sharedfs.sh" down "$dir"
    echo "test-sharedfs: $((SECONDS - t0)) s in all (rc=$rc)" >&2
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

"$here/sharedfs.sh" up "$dir" || { echo "test-sharedfs: setup failed" >&2; exit 1; }
echo "test-sharedfs: set up after $((SECONDS - t0)) s" >&2

cd "$repo" || exit 1
# This checkout's fstier, whatever checkout the venv's editable install
# points at (a git worktree shares the main checkout's venv).
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
targets=(tests/sharedfs)
for a in "$@"; do [[ $a == tests/* ]] && targets=(); done
# setsid: the tests (and every process they start) form one process group
# that cleanup can end; `wait` returns at once when a signal arrives.
FSTIER_SHAREDFS_ENV="$dir/env.json" FSTIER_REQUIRE_SHAREDFS=1 \
    setsid timeout -k 15 "$limit" "$py" -m pytest -q -p no:cacheprovider "${targets[@]}" "$@" &
tests_pid=$!
wait "$tests_pid"
rc=$?
echo "test-sharedfs: tests ended after $((SECONDS - t0)) s" >&2
if ((rc == 124)); then echo "test-sharedfs: tests exceeded ${limit}s" >&2; fi
if ((rc == 5)); then echo "test-sharedfs: pytest collected no tests: failing" >&2; rc=1; fi
exit "$rc"
