#!/usr/bin/env bash
# Real shared filesystems for fstier's tests: GlusterFS, MooseFS and CephFS,
# each with its servers in one network namespace and two FUSE clients
# ("hosts" a and b) in two others, all on a private bridge that exists only
# inside those namespaces (nothing is addressed in the root namespace).
# FSTIER_SHAREDFS_FILESYSTEMS (default: all three) names the ones `up`
# stands up; DIR/env.json lists them, with the faults each one offers.
#
#   sharedfs.sh install          install the Debian packages (idempotent)
#   sharedfs.sh up DIR           stand everything up under the new DIR; writes DIR/env.json
#   sharedfs.sh down DIR         tear down what DIR records (idempotent, never fails)
#   sharedfs.sh sweep            tear down leftovers of runs whose owner died
#   sharedfs.sh fault DIR WHAT   gluster-kill | gluster-start | mfs-kill | mfs-start
#                                | ceph-osd-kill | ceph-osd-start | ceph-mds-kill
#                                | ceph-mds-start | link-down-a | link-up-a
#   sharedfs.sh serve DIR        run the faults named on stdin, one a line (the tests)
#
# Every process this script starts runs inside one of its own namespaces, so
# teardown kills exactly `ip netns pids` of those namespaces; mounts and loop
# devices are recorded in DIR and undone in reverse order. Names carry a
# per-run id so two runs on one machine never collide; every file a daemon
# writes (Ceph's admin sockets, pid files, logs, cluster log) lives under DIR;
# `sweep` tears down only runs whose owner pid is gone.
set -uo pipefail

PKGS="glusterfs-server glusterfs-client moosefs-master moosefs-chunkserver moosefs-client moosefs-cli xfsprogs
      ceph-mon ceph-mgr ceph-osd ceph-mds ceph-fuse"
# What `up` stands up (FSTIER_SHAREDFS_FILESYSTEMS narrows it for a quick
# run on one); env.json lists exactly these, and the tests run on each.
ALL_FS="glusterfs moosefs cephfs"
# CephFS: a second data pool for the ENOSPC tests (a test points its
# directory at it with the ceph.dir.layout.pool xattr); `ceph-quota-on` gives
# it a quota of what it holds now plus CEPH_FULL_POOL_BYTES, `ceph-quota-off`
# lifts it (which also resumes any op paused on the full pool).
CEPH_FULL_POOL=fstier_full
CEPH_FULL_POOL_BYTES=$((8 << 20))
BASE=/var/tmp
PREFIX=fstier-sharedfs-

log() { echo "sharedfs: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND every 0.2 s until it
# succeeds; fail after SECONDS.
wait_for() {
    local limit=$1 what=$2; shift 2
    local end=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= end)); then
            log "timed out after ${limit}s waiting for: $what"
            return 1
        fi
        sleep 0.2
    done
}

cmd_install() {
    local missing=0 p
    for p in glusterd glusterfs gluster mfsmaster mfschunkserver mfsmount mfssetgoal mkfs.xfs \
        ceph ceph-mon ceph-mgr ceph-osd ceph-mds ceph-fuse monmaptool; do
        command -v "$p" >/dev/null 2>&1 || missing=1
    done
    if ((missing == 0)); then
        log "packages already installed"
        return 0
    fi
    log "installing: $PKGS"
    export DEBIAN_FRONTEND=noninteractive
    # A second run installing at the same time waits for dpkg's lock.
    timeout 300 apt-get -o DPkg::Lock::Timeout=240 update -q >/dev/null || die "apt-get update failed"
    # shellcheck disable=SC2086
    timeout 600 apt-get -o DPkg::Lock::Timeout=240 install -y -q --no-install-recommends $PKGS >/dev/null \
        || die "apt-get install failed"
}

# ------------------------------------------------------------------ helpers
ns_exec() { local ns=$1; shift; nsenter --net="/run/netns/$ns" "$@"; }

# From the mount table, never a stat of the path: a stat of a FUSE mount
# whose server died blocks forever (test_faults' MDS kill left one).
is_mounted() { awk -v m="$1" '$5 == m { f = 1 } END { exit !f }' /proc/self/mountinfo; }

# Abort the FUSE connection of mount $1 (every request blocked on it fails
# ENOTCONN), so that nothing waits on a FUSE server that hangs.
fuse_abort() {
    local dev
    dev=$(awk -v m="$1" '$5 == m { print $3 }' /proc/self/mountinfo)
    [[ -n $dev ]] || return 0
    [[ -d /sys/fs/fuse/connections/${dev#*:} ]] \
        || mount -t fusectl fusectl /sys/fs/fuse/connections 2>/dev/null
    echo 1 >"/sys/fs/fuse/connections/${dev#*:}/abort" 2>/dev/null
}

# A FUSE mount is ready when it answers a stat and lists its root.
fuse_ready() { is_mounted "$1" && timeout 5 ls "$1" >/dev/null 2>&1 && timeout 5 stat -f "$1" >/dev/null 2>&1; }

record() { echo "$2" >>"$1/$3"; }

filesystems() {
    local fs
    for fs in ${FSTIER_SHAREDFS_FILESYSTEMS:-$ALL_FS}; do
        echo "$fs"
    done
}

# One XFS loop filesystem holds the GlusterFS brick and the MooseFS chunks.
ensure_disk() {
    local dir=$1
    is_mounted "$dir/disk" && return 0
    truncate -s 4G "$dir/disk.img" || return 1
    mkfs.xfs -q -f -i size=512 "$dir/disk.img" || return 1
    mkdir -p "$dir/disk"
    mount -o loop "$dir/disk.img" "$dir/disk" || return 1
    record "$dir" "$dir/disk" mounts
}

# Per run: the volume name and glusterd's CLI socket (the default socket and
# brick pid directory are machine-wide).
vol_of() { echo "fstkv$(basename "$1" | sed "s/^$PREFIX//")"; }
gl() {
    local dir=$1 nss
    shift
    nss=$(awk '{print $1}' "$dir/namespaces")
    timeout 60 nsenter --net="/run/netns/$nss" gluster --mode=script \
        --glusterd-sock="$dir/gluster/glusterd.socket" "$@"
}

# ------------------------------------------------------------------ up
cmd_up() {
    local dir=$1
    [[ -e $dir ]] && die "$dir exists"
    mkdir -p "$dir" || die "cannot create $dir"
    local id
    id=$(basename "$dir" | sed "s/^$PREFIX//")
    # Written whole then renamed: a sweep never reads an empty owner.
    echo "${FSTIER_SHAREDFS_OWNER:-$PPID}" >"$dir/owner.tmp" && mv "$dir/owner.tmp" "$dir/owner"
    local nss="fst${id}s" nsa="fst${id}a" nsb="fst${id}b"
    echo "$nss $nsa $nsb" >"$dir/namespaces"
    # A private /24 per run, chosen from the id, only inside the namespaces.
    local net="10.$((200 + id % 50)).$((id / 50 % 250)).0"
    local pfx=${net%.0}
    local srv="$pfx.1" ipa="$pfx.2" ipb="$pfx.3"
    echo "$srv" >"$dir/srv_ip"

    log "namespaces $nss $nsa $nsb, server $srv"
    ip netns add "$nss" && ip netns add "$nsa" && ip netns add "$nsb" || return 1
    ip -n "$nss" link set lo up
    ip -n "$nss" link add br0 type bridge || return 1
    ip -n "$nss" addr add "$srv/24" dev br0
    ip -n "$nss" link set br0 up
    local ns peer ip
    for ns in a b; do
        if [[ $ns == a ]]; then peer=$nsa; ip=$ipa; else peer=$nsb; ip=$ipb; fi
        ip link add name eth0 netns "$peer" type veth peer name "v$ns" netns "$nss" || return 1
        ip -n "$nss" link set "v$ns" master br0
        ip -n "$nss" link set "v$ns" up
        ip -n "$peer" link set lo up
        ip -n "$peer" addr add "$ip/24" dev eth0
        ip -n "$peer" link set eth0 up
    done

    local fs entries=()
    for fs in $(filesystems); do
        case $fs in
            glusterfs | moosefs) ensure_disk "$dir" || return 1 ;;
        esac
        case $fs in
            glusterfs)
                up_gluster "$dir" "$nss" "$nsa" "$nsb" "$srv" || return 1
                entries+=("\"glusterfs\": {\"a\": \"$dir/mnt/gluster-a\", \"b\": \"$dir/mnt/gluster-b\",
      \"kill\": \"gluster-kill\", \"start\": \"gluster-start\",
      \"faults\": {\"bricks\": [\"gluster-kill\", \"gluster-start\"]}}")
                ;;
            moosefs)
                up_moosefs "$dir" "$nss" "$nsa" "$nsb" "$srv" || return 1
                entries+=("\"moosefs\": {\"a\": \"$dir/mnt/mfs-a\", \"b\": \"$dir/mnt/mfs-b\",
      \"kill\": \"mfs-kill\", \"start\": \"mfs-start\",
      \"faults\": {\"chunkserver\": [\"mfs-kill\", \"mfs-start\"]}}")
                ;;
            cephfs)
                up_ceph "$dir" "$nss" "$nsa" "$nsb" "$srv" "$net" || return 1
                entries+=("\"cephfs\": {\"a\": \"$dir/mnt/ceph-a\", \"b\": \"$dir/mnt/ceph-b\",
      \"kill\": \"ceph-osd-kill\", \"start\": \"ceph-osd-start\",
      \"faults\": {\"osd\": [\"ceph-osd-kill\", \"ceph-osd-start\"],
                 \"mds\": [\"ceph-mds-kill\", \"ceph-mds-start\"]},
      \"full_pool\": \"$CEPH_FULL_POOL\", \"full_pool_bytes\": $CEPH_FULL_POOL_BYTES,
      \"full_pool_quota\": [\"ceph-quota-on\", \"ceph-quota-off\"]}")
                ;;
            *) log "unknown filesystem $fs (FSTIER_SHAREDFS_FILESYSTEMS)"; return 1 ;;
        esac
    done
    local joined
    joined=$(printf ',\n    %s' "${entries[@]}")
    cat >"$dir/env.json.tmp" <<EOF
{
  "script": "$(readlink -f "$0")",
  "dir": "$dir",
  "filesystems": {${joined#,}
  }
}
EOF
    mv "$dir/env.json.tmp" "$dir/env.json"
    log "up: $dir/env.json"
}

up_gluster() {
    local dir=$1 nss=$2 nsa=$3 nsb=$4 srv=$5
    local g="$dir/gluster"
    mkdir -p "$g/work" "$g/log" "$dir/disk/brick" "$dir/mnt/gluster-a" "$dir/mnt/gluster-b"
    local vol
    vol=$(vol_of "$dir")
    sed -e "s#option working-directory .*#option working-directory $g/work\n    option glusterd-sockfile $g/glusterd.socket#" \
        /etc/glusterfs/glusterd.vol >"$g/glusterd.vol"
    # glusterd keeps brick pid files under /var/run/gluster/vols/<volume>.
    rm -rf "/var/run/gluster/vols/$vol"
    log "glusterd, volume $vol"
    ns_exec "$nss" glusterd -f "$g/glusterd.vol" -p "$g/glusterd.pid" \
        --log-file="$g/log/glusterd.log" || { log "glusterd did not start"; return 1; }
    wait_for 30 "glusterd answers" gl "$dir" pool list || return 1
    gl "$dir" volume create "$vol" transport tcp "$srv:$dir/disk/brick/data" force >/dev/null \
        || { log "gluster volume create failed"; return 1; }
    gl "$dir" volume start "$vol" >/dev/null || { log "gluster volume start failed"; return 1; }
    local m ns
    for m in a b; do
        if [[ $m == a ]]; then ns=$nsa; else ns=$nsb; fi
        ns_exec "$ns" glusterfs --volfile-server="$srv" --volfile-id="$vol" \
            --log-file="$g/log/client-$m.log" "$dir/mnt/gluster-$m" \
            || { log "glusterfs client $m did not start"; return 1; }
        record "$dir" "$dir/mnt/gluster-$m" mounts
        wait_for 60 "GlusterFS mount $m" fuse_ready "$dir/mnt/gluster-$m" || return 1
    done
    # Both clients see one volume: a file made through a shows up on b.
    echo probe >"$dir/mnt/gluster-a/.probe" || return 1
    wait_for 30 "GlusterFS a -> b" test -e "$dir/mnt/gluster-b/.probe" || return 1
    rm -f "$dir/mnt/gluster-a/.probe"
}

up_moosefs() {
    local dir=$1 nss=$2 nsa=$3 nsb=$4 srv=$5
    local m="$dir/mfs"
    mkdir -p "$m/master" "$m/cs" "$dir/disk/chunks" "$dir/mnt/mfs-a" "$dir/mnt/mfs-b"
    cp /var/lib/mfs/metadata.mfs.empty "$m/master/metadata.mfs" || return 1
    echo "*  /  rw,alldirs,admin,maproot=0:0" >"$m/exports.cfg"
    cat >"$m/master.cfg" <<EOF
WORKING_USER = root
WORKING_GROUP = root
DATA_PATH = $m/master
EXPORTS_FILENAME = $m/exports.cfg
TOPOLOGY_FILENAME = $m/topology.cfg
MATOML_LISTEN_HOST = $srv
MATOCS_LISTEN_HOST = $srv
MATOCL_LISTEN_HOST = $srv
NICE_LEVEL = 0
EOF
    touch "$m/topology.cfg"
    echo "$dir/disk/chunks" >"$m/hdd.cfg"
    cat >"$m/cs.cfg" <<EOF
WORKING_USER = root
WORKING_GROUP = root
DATA_PATH = $m/cs
HDD_CONF_FILENAME = $m/hdd.cfg
MASTER_HOST = $srv
BIND_HOST = $srv
CSSERV_LISTEN_HOST = $srv
HDD_TEST_FREQ = 0
NICE_LEVEL = 0
EOF
    log "mfsmaster, mfschunkserver"
    ns_exec "$nss" mfsmaster -c "$m/master.cfg" start >"$m/master.out" 2>&1 \
        || { cat "$m/master.out" >&2; return 1; }
    ns_exec "$nss" mfschunkserver -c "$m/cs.cfg" start >"$m/cs.out" 2>&1 \
        || { cat "$m/cs.out" >&2; return 1; }
    local x ns
    for x in a b; do
        if [[ $x == a ]]; then ns=$nsa; else ns=$nsb; fi
        ns_exec "$ns" mfsmount "$dir/mnt/mfs-$x" -H "$srv" -S / >"$m/mount-$x.out" 2>&1 \
            || { cat "$m/mount-$x.out" >&2; return 1; }
        record "$dir" "$dir/mnt/mfs-$x" mounts
        wait_for 60 "MooseFS mount $x" fuse_ready "$dir/mnt/mfs-$x" || return 1
    done
    mfssetgoal -r 1 "$dir/mnt/mfs-a" >/dev/null 2>&1 || true
    # Writes need the chunkserver registered with the master: retry a write.
    wait_for 60 "MooseFS chunkserver accepts writes" \
        bash -c "echo probe >'$dir/mnt/mfs-a/.probe' && sync '$dir/mnt/mfs-a/.probe' && cat '$dir/mnt/mfs-b/.probe'" \
        || return 1
    rm -f "$dir/mnt/mfs-a/.probe"
}

# CephFS: one mon, one mgr, one OSD (BlueStore on a sparse file), one MDS in
# the server namespace, no cephx (a private network inside namespaces), and a
# ceph-fuse client per host. Every daemon and every mkfs runs in the server
# namespace (they bind to its address); every `ceph` call is bounded (with no
# mon it would wait forever).
ceph_cli() {
    local dir=$1 nss
    shift
    nss=$(awk '{print $1}' "$dir/namespaces")
    timeout 30 nsenter --net="/run/netns/$nss" ceph -c "$dir/ceph/ceph.conf" --connect-timeout 10 "$@"
}

ceph_mds_active() { ceph_cli "$1" mds stat 2>/dev/null | grep -q 'up:active'; }
ceph_osd_up() { ceph_cli "$1" osd stat 2>/dev/null | grep -q '1 up'; }

up_ceph() {
    local dir=$1 nss=$2 nsa=$3 nsb=$4 srv=$5 net=$6
    local c="$dir/ceph"
    mkdir -p "$c/mon/ceph-a" "$c/mgr/ceph-x" "$c/osd/ceph-0" "$c/mds/ceph-a" "$c/run" "$c/log" \
        "$dir/mnt/ceph-a" "$dir/mnt/ceph-b"
    local fsid
    fsid=$(cat /proc/sys/kernel/random/uuid)
    # The settings are those of ../shared notes' single-node cluster: one copy,
    # memory caps, and faster objecter/MDS ticks (Ceph's 5 s/10 s/5 s make
    # recovery after a fault and a first read on the other client wait
    # seconds longer).
    cat >"$c/ceph.conf" <<EOF
[global]
fsid = $fsid
mon host = [v2:$srv:3300,v1:$srv:6789]
mon initial members = a
public network = $net/24
ms bind ipv6 = false
auth cluster required = none
auth service required = none
auth client required = none
run dir = $c/run
admin socket = $c/run/\$cluster-\$name.asok
pid file = $c/run/\$name.pid
log file = $c/log/\$name.log
mon cluster log file = $c/log/\$cluster.\$channel.log
keyring = $c/keyring
osd pool default size = 1
osd pool default min size = 1
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon warn on pool no redundancy = false
mon osd down out interval = 0
osd crush chooseleaf type = 0
objecter tick interval = 1
objecter timeout = 2
# Pool usage reaches the monitors sooner: a pool quota turns into ENOSPC
# after ~5 s instead of ~13 s.
mgr stats period = 1
mon mgr digest period = 1
[mon]
mon data = $c/mon/\$cluster-\$id
[mgr]
mgr data = $c/mgr/\$cluster-\$id
[osd]
osd data = $c/osd/\$cluster-\$id
osd objectstore = bluestore
bluestore block create = true
bluestore block size = $((8 << 30))
bluestore fsck on mount = false
osd memory target = $((896 << 20))
[mds]
mds data = $c/mds/\$cluster-\$id
mds cache memory limit = $((128 << 20))
mds tick interval = 0.2
EOF
    touch "$c/keyring"
    log "ceph: mon, mgr, osd, mds"
    monmaptool --create --fsid "$fsid" --addv a "[v2:$srv:3300,v1:$srv:6789]" "$c/monmap" >/dev/null \
        || { log "monmaptool failed"; return 1; }
    ns_exec "$nss" ceph-mon -c "$c/ceph.conf" --mkfs -i a --monmap "$c/monmap" >"$c/mon.out" 2>&1 \
        || { cat "$c/mon.out" >&2; log "ceph-mon --mkfs failed"; return 1; }
    ns_exec "$nss" ceph-mon -c "$c/ceph.conf" -i a || { log "ceph-mon did not start"; return 1; }
    wait_for 30 "ceph mon answers" ceph_cli "$dir" mon stat || return 1
    ns_exec "$nss" ceph-mgr -c "$c/ceph.conf" -i x || { log "ceph-mgr did not start"; return 1; }
    local uuid osd
    uuid=$(cat /proc/sys/kernel/random/uuid)
    osd=$(ceph_cli "$dir" osd new "$uuid") || { log "ceph osd new failed"; return 1; }
    [[ $osd == 0 ]] || { log "ceph osd new gave id '$osd', expected 0"; return 1; }
    ns_exec "$nss" ceph-osd -c "$c/ceph.conf" -i 0 --mkfs --osd-uuid "$uuid" >"$c/osd-mkfs.out" 2>&1 \
        || { cat "$c/osd-mkfs.out" >&2; return 1; }
    ns_exec "$nss" ceph-osd -c "$c/ceph.conf" -i 0 >>"$c/osd-mkfs.out" 2>&1 \
        || { cat "$c/osd-mkfs.out" >&2; log "ceph-osd did not start"; return 1; }
    {
        ceph_cli "$dir" osd pool create cephfs_metadata 16 \
            && ceph_cli "$dir" osd pool create cephfs_data 32 \
            && ceph_cli "$dir" osd pool create "$CEPH_FULL_POOL" 8 \
            && ceph_cli "$dir" fs new fstierfs cephfs_metadata cephfs_data \
            && ceph_cli "$dir" fs add_data_pool fstierfs "$CEPH_FULL_POOL"
    } >"$c/pools.out" 2>&1 || { cat "$c/pools.out" >&2; log "ceph pools / fs new failed"; return 1; }
    ns_exec "$nss" ceph-mds -c "$c/ceph.conf" -i a >"$c/mds.out" 2>&1 \
        || { cat "$c/mds.out" >&2; log "ceph-mds did not start"; return 1; }
    wait_for 60 "ceph OSD up" ceph_osd_up "$dir" || return 1
    wait_for 60 "ceph MDS active" ceph_mds_active "$dir" || return 1
    local x ns
    for x in a b; do
        if [[ $x == a ]]; then ns=$nsa; else ns=$nsb; fi
        ns_exec "$ns" ceph-fuse -c "$c/ceph.conf" --id "$x" "$dir/mnt/ceph-$x" >"$c/fuse-$x.out" 2>&1 \
            || { cat "$c/fuse-$x.out" >&2; return 1; }
        record "$dir" "$dir/mnt/ceph-$x" mounts
        wait_for 60 "CephFS mount $x" fuse_ready "$dir/mnt/ceph-$x" || return 1
    done
    wait_for 60 "CephFS a -> b" \
        bash -c "echo probe >'$dir/mnt/ceph-a/.probe' && sync '$dir/mnt/ceph-a/.probe' && cat '$dir/mnt/ceph-b/.probe'" \
        || return 1
    rm -f "$dir/mnt/ceph-a/.probe"
}

# The pid of a Ceph daemon of this run (TYPE: osd, mds), not a zombie.
ceph_pid() {
    local dir=$1 type=$2 nss pid
    nss=$(awk '{print $1}' "$dir/namespaces")
    for pid in $(ip netns pids "$nss" 2>/dev/null); do
        [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) == Z ]] && continue
        if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "ceph-$type -c $dir/ceph/ceph.conf"; then
            echo "$pid"
        fi
    done
}

ceph_kill() {
    local dir=$1 type=$2 pid
    for pid in $(ceph_pid "$dir" "$type"); do kill -9 "$pid" 2>/dev/null; done
    wait_for 10 "ceph-$type gone" test -z "$(ceph_pid "$dir" "$type")"
}

ceph_start() {
    local dir=$1 type=$2 id nss
    nss=$(awk '{print $1}' "$dir/namespaces")
    if [[ $type == osd ]]; then id=0; else id=a; fi
    [[ -n $(ceph_pid "$dir" "$type") ]] && return 0
    # Its output goes to a file (`serve` answers on stdout); setsid: out of
    # the tests' process group, which run.sh's cleanup SIGTERMs (a restarted
    # MDS killed that way left both clients hanging).
    ns_exec "$nss" setsid "ceph-$type" -c "$dir/ceph/ceph.conf" -i "$id" >>"$dir/ceph/restart.out" 2>&1
}

# ------------------------------------------------------------------ faults
mfs_cs_pid() {
    local dir=$1 nss pid
    nss=$(awk '{print $1}' "$dir/namespaces")
    for pid in $(ip netns pids "$nss" 2>/dev/null); do
        if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "mfschunkserver -c $dir/mfs/cs.cfg"; then
            echo "$pid"
        fi
    done
}

cmd_fault() {
    local dir=$1 what=$2 nss nsa pid f
    read -r nss nsa _ <"$dir/namespaces"
    case $what in
        gluster-kill)
            # Remove the pid file too: glusterd takes a pid that still exists
            # (a zombie not reaped yet) for a running brick and would not
            # restart it.
            for f in /var/run/gluster/vols/"$(vol_of "$dir")"/*.pid; do
                [[ -f $f ]] || continue
                pid=$(cat "$f")
                [[ -n $pid ]] && kill -9 "$pid" 2>/dev/null
                rm -f "$f"
            done
            ;;
        gluster-start)
            gl "$dir" volume start "$(vol_of "$dir")" force >/dev/null
            ;;
        mfs-kill)
            for pid in $(mfs_cs_pid "$dir"); do kill -9 "$pid"; done
            rm -f "$dir/mfs/cs/.mfschunkserver.lock"
            ;;
        mfs-start)
            ns_exec "$nss" setsid mfschunkserver -c "$dir/mfs/cs.cfg" start >>"$dir/mfs/cs.out" 2>&1
            ;;
        ceph-osd-kill) ceph_kill "$dir" osd ;;
        ceph-osd-start) ceph_start "$dir" osd ;;
        ceph-mds-kill) ceph_kill "$dir" mds ;;
        ceph-mds-start) ceph_start "$dir" mds ;;
        ceph-quota-on)
            local stored
            stored=$(ceph_cli "$dir" df --format json 2>/dev/null | python3 -c "
import json, sys
print(next(p['stats']['stored'] for p in json.load(sys.stdin)['pools'] if p['name'] == '$CEPH_FULL_POOL'))") \
                || return 1
            ceph_cli "$dir" osd pool set-quota "$CEPH_FULL_POOL" max_bytes $((stored + CEPH_FULL_POOL_BYTES)) >/dev/null 2>&1
            ;;
        ceph-quota-off)
            ceph_cli "$dir" osd pool set-quota "$CEPH_FULL_POOL" max_bytes 0 >/dev/null 2>&1
            # The monitor clears the pool's full_quota flag at a later stats tick: a test that sets the next
            # quota before then finds the pool still full (ENOSPC at its first write). Wait for it (<= 30 s).
            local i
            for i in $(seq 60); do
                ceph_cli "$dir" osd pool ls detail 2>/dev/null | grep "'$CEPH_FULL_POOL'" | grep -q full_quota || break
                sleep 0.5
            done
            ;;
        link-down-a) ip -n "$nsa" link set eth0 down ;;
        link-up-a) ip -n "$nsa" link set eth0 up ;;
        *) die "unknown fault $what" ;;
    esac
}

# ------------------------------------------------------------------ down
kill_ns_pids() {
    local sig=$1 ns pid
    shift
    for ns in "$@"; do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do
            kill "-$sig" "$pid" 2>/dev/null
        done
    done
}

ns_has_pids() {
    local ns
    for ns in "$@"; do
        [[ -n $(ip netns pids "$ns" 2>/dev/null) ]] && return 0
    done
    return 1
}

cmd_down() {
    local dir=$1
    [[ -d $dir ]] || return 0
    log "tearing down $dir"
    local nss="" nsa="" nsb=""
    [[ -f $dir/namespaces ]] && read -r nss nsa nsb <"$dir/namespaces"
    # Bring links back up so that a clean unmount is possible.
    [[ -n $nsa ]] && ip -n "$nsa" link set eth0 up 2>/dev/null
    # Clients first: detach the FUSE mounts lazily (a plain umount of a
    # mount whose server hangs blocks), then stop the servers.
    local mounts=() m
    [[ -f $dir/mounts ]] && mapfile -t mounts <"$dir/mounts"
    local i
    for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
        m=${mounts[i]}
        [[ $m == "$dir/disk" ]] && continue
        is_mounted "$m" && umount -l "$m" 2>/dev/null
    done
    if [[ -n $nss ]] && [[ -S $dir/gluster/glusterd.socket ]]; then
        gl "$dir" volume stop "$(vol_of "$dir")" force >/dev/null 2>&1
    fi
    if [[ -n $nss ]]; then
        # Ceph's daemons hold nothing worth a clean stop here, and a SIGTERMed
        # MDS takes over 5 s: kill them outright.
        local t pid
        for t in mds osd mgr mon; do
            for pid in $(ceph_pid "$dir" "$t"); do kill -9 "$pid" 2>/dev/null; done
        done
        kill_ns_pids TERM "$nss" "$nsa" "$nsb"
        local end=$((SECONDS + 10))
        while ns_has_pids "$nss" "$nsa" "$nsb" && ((SECONDS < end)); do sleep 0.2; done
        kill_ns_pids KILL "$nss" "$nsa" "$nsb"
        end=$((SECONDS + 10))
        while ns_has_pids "$nss" "$nsa" "$nsb" && ((SECONDS < end)); do sleep 0.2; done
    fi
    # Anything still mounted (a FUSE mount whose client was just killed).
    for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
        m=${mounts[i]}
        if is_mounted "$m"; then
            [[ $m == "$dir/disk" ]] || fuse_abort "$m"
            timeout 20 umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null
        fi
    done
    # The loop device of disk.img (mount -o loop sets autoclear; detach any left).
    local loopdev
    for loopdev in $(losetup -j "$dir/disk.img" -O NAME -n 2>/dev/null); do
        losetup -d "$loopdev" 2>/dev/null
    done
    local ns
    for ns in $nss $nsa $nsb; do
        ip netns del "$ns" 2>/dev/null
    done
    rm -rf "/var/run/gluster/vols/$(vol_of "$dir")"
    local tag
    tag=$(echo "$dir" | sed 's#^/##; s#/#-#g')
    rm -f /var/log/glusterfs/bricks/"$tag"-*.log
    # Keep the logs of a failed run next to the state dir's name, drop the rest.
    if [[ -n ${FSTIER_SHAREDFS_KEEP_LOGS:-} ]]; then
        mkdir -p "$FSTIER_SHAREDFS_KEEP_LOGS"
        cp -r "$dir/gluster/log" "$FSTIER_SHAREDFS_KEEP_LOGS/gluster-log" 2>/dev/null
        cp "$dir"/mfs/*.out "$FSTIER_SHAREDFS_KEEP_LOGS/" 2>/dev/null
        cp -r "$dir/ceph/log" "$FSTIER_SHAREDFS_KEEP_LOGS/ceph-log" 2>/dev/null
    fi
    local left=0
    for m in "${mounts[@]}"; do is_mounted "$m" && left=1; done
    if ((left)); then
        log "WARNING: mounts under $dir are still busy; leaving $dir"
        return 0
    fi
    rm -rf "$dir"
    return 0
}

cmd_sweep() {
    local d owner
    for d in "$BASE/$PREFIX"*; do
        [[ -d $d ]] || continue
        owner=$(cat "$d/owner" 2>/dev/null)
        if [[ -z $owner ]]; then
            # A run between its mkdir and writing its owner (a live one) has
            # no owner yet: only a dir left that way for 10 minutes is dead.
            [[ -n $(find "$d" -maxdepth 0 -mmin +10 2>/dev/null) ]] || continue
        elif kill -0 "$owner" 2>/dev/null; then
            continue
        fi
        log "removing leftovers of a dead run: $d"
        cmd_down "$d"
    done
}

case ${1:-} in
    install) cmd_install ;;
    up)
        [[ $# -eq 2 ]] || die "usage: $0 up DIR"
        cmd_up "$2" || { log "setup failed; tearing down"; cmd_down "$2"; exit 1; }
        ;;
    down) [[ $# -eq 2 ]] || die "usage: $0 down DIR"; cmd_down "$2" ;;
    sweep) cmd_sweep ;;
    fault) [[ $# -eq 3 ]] || die "usage: $0 fault DIR WHAT"; cmd_fault "$2" "$3" ;;
    serve)
        # One fault per input line, answered "ok" or "failed". The tests start
        # this before they open any file on the mounts: a process forked
        # while fstier holds files open on a FUSE mount inherits them, and
        # closing them in the child flushes through the mount, which blocks
        # while the servers are down (the fault could never be undone).
        [[ $# -eq 2 ]] || die "usage: $0 serve DIR"
        while read -r what; do
            if cmd_fault "$2" "$what"; then echo ok; else echo failed; fi
        done
        ;;
    *) die "usage: $0 install | up DIR | down DIR | sweep | fault DIR WHAT" ;;
esac
