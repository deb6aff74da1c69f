#!/usr/bin/env bash
# A real SLURM cluster for the tests (Debian 12: slurmctld slurmd slurmdbd munge mariadb), started as
# root without systemd: one node (this machine), or with a second argument `2` two nodes, lnode1 and
# lnode2, each slurmd in a network and UTS namespace of its own (see below). Everything it writes lives under $1 (default /tmp/launch-slurm):
# slurm.conf, logs, state, and the pid files stop.sh uses. Clients find it with SLURM_CONF=$1/slurm.conf.
#
#   slurm/testcluster/start.sh /tmp/launch-slurm [2] && export SLURM_CONF=/tmp/launch-slurm/slurm.conf
#   ... sbatch / launch backend=slurm ...
#   slurm/testcluster/stop.sh /tmp/launch-slurm
#
# Accounting (slurmdbd + MariaDB over its socket only) is not optional: submitit reads job states
# through sacct, and without it every state is UNKNOWN and waiting on a killed job never ends.
set -euo pipefail
DIR=$(realpath -m "${1:-/tmp/launch-slurm}")
NODES=${2:-1}  # 2: two slurmd, each in a network namespace (and UTS namespace) of its own (below)
HOST=$(hostname -s)
mkdir -p "$DIR"/{log,state,spool,pids,db}
chmod 1777 "$DIR/pids"  # mariadbd writes its pid file as user mysql
chmod 755 "$DIR"

grep -qE "^[0-9.]+\s+.*\b$HOST\b" /etc/hosts || echo "127.0.0.1 $HOST" >> /etc/hosts

# munge: the daemon authenticates every SLURM message
install -d -o munge -g munge -m 0755 /run/munge
[ -s /etc/munge/munge.key ] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null;
                                 chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
if ! pgrep -u munge -x munged >/dev/null; then  # one already running (a system's own) is used, not ours to stop
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
    cp /run/munge/munged.pid "$DIR/pids/munged.pid"
fi

# MariaDB for slurmdbd: socket only, data under $DIR
install -d -o mysql -g mysql -m 0755 /run/mysqld
chown mysql:mysql "$DIR/db"
if [ ! -d "$DIR/db/mysql" ]; then
    mariadb-install-db --user=mysql --datadir="$DIR/db" --auth-root-authentication-method=socket >"$DIR/log/mariadb-install.log" 2>&1
fi
/usr/sbin/mariadbd --user=mysql --datadir="$DIR/db" --skip-networking --socket=/run/mysqld/mysqld.sock \
    --pid-file="$DIR/pids/mariadbd.pid" >"$DIR/log/mariadb.log" 2>&1 &
for _ in $(seq 100); do [ -S /run/mysqld/mysqld.sock ] && mariadb -e "select 1" >/dev/null 2>&1 && break; sleep 0.1; done
mariadb -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm-test';
            GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"

CPUS=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # (GNU nproc reports OMP_NUM_THREADS where it is set)
MEM=$(( $(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo) / 2 ))
CTLD_HOST=$HOST
NODE_LINES="NodeName=$HOST CPUs=$CPUS RealMemory=$MEM State=UNKNOWN"
if [ "$NODES" = 2 ]; then
    # Two nodes as SLURM sees them: each slurmd in a network namespace with its own address (198.18.1.11
    # and .12: the benchmarking range, never routed) and a UTS namespace with its own host name (lnode1,
    # lnode2), joined to slurmctld (198.18.1.1, on a bridge here) and to each other by veth pairs. Jobs
    # run inside their node's namespaces; the file system is shared, as on a cluster. stop.sh removes it all.
    if ip link show lslbr0 >/dev/null 2>&1 || ip netns list | grep -q '^lslurm-n'; then
        echo "a two-node test cluster runs already (or was left behind): stop it with stop.sh DIR, or" \
             "ip link delete lslbr0; ip netns delete lslurm-n1; ip netns delete lslurm-n2" >&2
        exit 1
    fi
    ip link add lslbr0 type bridge
    echo lslbr0 > "$DIR/bridge"
    ip addr add 198.18.1.1/24 dev lslbr0
    ip link set lslbr0 up
    CTLD_HOST="$HOST(198.18.1.1)"
    NODE_LINES=""
    for i in 1 2; do
        ns=lslurm-n$i
        ip netns add $ns
        echo $ns >> "$DIR/netns"
        ip link add lslh$i type veth peer name lsln$i
        ip link set lslh$i master lslbr0 up
        ip link set lsln$i netns $ns
        ip -n $ns addr add 198.18.1.1$i/24 dev lsln$i
        ip -n $ns link set lsln$i up
        ip -n $ns link set lo up
        mkdir -p /etc/netns/$ns
        printf '%s\n' "127.0.0.1 localhost" "::1 localhost" "198.18.1.1 $HOST" "::ffff:198.18.1.1 $HOST" \
            "198.18.1.11 lnode1" "::ffff:198.18.1.11 lnode1" "198.18.1.12 lnode2" "::ffff:198.18.1.12 lnode2" \
            > /etc/netns/$ns/hosts
        NODE_LINES="$NODE_LINES
NodeName=lnode$i NodeAddr=198.18.1.1$i NodeHostname=lnode$i CPUs=$CPUS RealMemory=$(( MEM / 2 )) State=UNKNOWN"
    done
fi
cat > "$DIR/slurm.conf" <<CONF
ClusterName=launchtest
SlurmctldHost=$CTLD_HOST
SlurmUser=root
AuthType=auth/munge
# a requeued job may start again after 10 s instead of 121 (read at slurmctld start only)
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=sched_interval=1,bf_interval=1
ReturnToService=2
MpiDefault=none
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/pids/slurmctld.pid
SlurmdPidFile=$DIR/pids/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
KillWait=5
$NODE_LINES
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO LLN=YES
CONF
cat > "$DIR/slurmdbd.conf" <<CONF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=$DIR/pids/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=slurm_acct_db
StorageUser=slurm
StoragePass=slurm-test
CONF
chmod 600 "$DIR/slurmdbd.conf"
export SLURM_CONF="$DIR/slurm.conf"

/usr/sbin/slurmdbd
for _ in $(seq 100); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.1; done
sacctmgr -i add cluster launchtest >/dev/null 2>&1 || true
/usr/sbin/slurmctld
if [ "$NODES" = 2 ]; then
    for i in 1 2; do
        # (nsenter, not `ip netns exec`: that remounts /sys, and slurmd wants the cgroup mounts under it)
        nsenter --net=/run/netns/lslurm-n$i unshare --mount --uts --propagation private sh -c \
            "mount --bind /etc/netns/lslurm-n$i/hosts /etc/hosts && hostname lnode$i && exec /usr/sbin/slurmd -N lnode$i"
    done
else
    /usr/sbin/slurmd
fi
for _ in $(seq 200); do sinfo -h -o %T 2>/dev/null | grep -qE "^idle" && break; sleep 0.1; done
sinfo -h -o "%P %D %T %c" | sed "s/^/slurm test cluster: /"
