#!/usr/bin/env bash
# A real SLURM cluster (munge + slurmctld + one slurmd per node) for development and tests,
# on a Debian/Ubuntu machine without systemd (containers, CI runners, laptops). It runs N
# slurmd on this one host, each a distinct SLURM node (n1..nN) with its own port and loopback
# address (127.0.1.i, mapped in /etc/hosts), so that multi-node jobs run here for real.
#
#   slurm/dev-cluster.sh up [--nodes N]   install the packages if missing, write slurm.conf,
#                                 start the daemons (idempotent: returns at once when already up
#                                 with N nodes; another N rewrites the config and restarts them)
#   slurm/dev-cluster.sh down     stop the daemons this script started, by PID
#   slurm/dev-cluster.sh status   show the daemons and every node; exit 0 only when all are up
#   slurm/dev-cluster.sh env      print `export SLURM_CONF=...` (for `eval "$(... env)"`)
#
# Environment:
#   LAUNCHER_SLURM_DIR    folder with the config, state, logs and PID files
#                         (default /var/tmp/launcher-slurm)
#   LAUNCHER_SLURM_CPUS   CPUs each node declares (default 8; more than the machine has is fine:
#                         it lets several small jobs run side by side)
#   LAUNCHER_SLURM_NODES  node count when `up` gets no --nodes (default 1)
#
# Needs root (package install, munged runs as the munge user, slurmd as root).
# Why each slurm.conf line is there: see docs/slurm.md.
set -euo pipefail

STATE_DIR="${LAUNCHER_SLURM_DIR:-/var/tmp/launcher-slurm}"
NODE_CPUS="${LAUNCHER_SLURM_CPUS:-8}"
NUM_NODES="${LAUNCHER_SLURM_NODES:-1}"
MAX_NODES=32
# Node i is named n<i>, has the address 127.0.1.<i> and its slurmd listens on SLURMD_BASE_PORT+i.
SLURMD_BASE_PORT=7820
CONF="$STATE_DIR/slurm.conf"
RUN_DIR="$STATE_DIR/run"
LOG_DIR="$STATE_DIR/log"
MUNGE_DIR="$STATE_DIR/munge"
MUNGE_SOCKET_DIR=/run/munge
MARKER="# launcher dev-cluster"
PACKAGES=(slurmctld slurmd slurm-client munge)
START_TIMEOUT_S=60

log() { printf 'dev-cluster: %s\n' "$*" >&2; }
die() { printf 'dev-cluster: error: %s\n' "$*" >&2; exit 1; }

host_name() { hostname -s; }

node_names() { # n1 .. nN, one per line
  local i
  for ((i = 1; i <= NUM_NODES; i++)); do printf 'n%d\n' "$i"; done
}
node_addr() { printf '127.0.1.%d' "${1#n}"; }
slurmd_pidfile() { printf '%s/slurmd-%s.pid' "$RUN_DIR" "$1"; }

# --- process state ------------------------------------------------------------------------

# A PID counts as running only when /proc shows it in a state other than zombie/dead
# (stopped daemons linger as zombies here: kill -0 alone would say "alive") and its
# command name matches.
pid_running() {
  local pid="$1" want="$2" stat state comm
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
  comm="${stat#*(}"; comm="${comm%%)*}"
  state="${stat##*) }"; state="${state%% *}"
  case "$state" in Z|X|x) return 1 ;; esac
  [[ "$comm" == "$want"* ]]
}

pid_of() { # pid_of FILE -> prints the PID stored in FILE (empty when none)
  [[ -s "$1" ]] && tr -dc '0-9' <"$1" || true
}

daemon_running() { # daemon_running NAME PIDFILE
  pid_running "$(pid_of "$2")" "$1"
}

gone_within() { # gone_within TENTHS PID NAME: true once PID no longer runs NAME, polling every 0.1 s
  local i
  for ((i = 0; i < $1; i++)); do
    pid_running "$2" "$3" || return 0
    sleep 0.1
  done
  return 1
}

stop_pid() { # stop_pid NAME PIDFILE: TERM, wait up to 15 s, then KILL
  local name="$1" pidfile="$2" pid i
  pid=$(pid_of "$pidfile")
  if ! pid_running "$pid" "$name"; then
    rm -f "$pidfile"
    return 0
  fi
  log "stopping $name (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  if gone_within 150 "$pid" "$name"; then rm -f "$pidfile"; return 0; fi
  log "$name (pid $pid) ignored SIGTERM for 15 s: sending SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
  if gone_within 50 "$pid" "$name"; then rm -f "$pidfile"; return 0; fi
  die "$name (pid $pid) is still running after SIGKILL"
}

# --- install and configure ----------------------------------------------------------------

require_root() {
  [[ $(id -u) -eq 0 ]] || die "must run as root (it installs packages and starts munged/slurmd); try: sudo $0 $*"
}

install_packages() {
  local missing=() p
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  ((${#missing[@]} == 0)) && return 0
  command -v apt-get >/dev/null || die "packages missing (${missing[*]}) and no apt-get: install SLURM and munge by hand"
  log "installing ${missing[*]} (about 15 s)"
  local t0=$SECONDS
  # policy-rc.d may deny service starts in containers; that is fine, we start the daemons ourselves.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" \
    >"$STATE_DIR/apt.log" 2>&1 || {
    log "apt-get install failed; refreshing the package lists and retrying"
    apt-get update -q >>"$STATE_DIR/apt.log" 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" \
      >>"$STATE_DIR/apt.log" 2>&1 || die "apt-get install ${missing[*]} failed: see $STATE_DIR/apt.log"
  }
  log "installed in $((SECONDS - t0)) s"
}

real_memory_mb() {
  awk '/^MemTotal:/ { printf "%d", $2 / 1024 * 0.9 }' /proc/meminfo
}

render_conf() {
  local host node
  host=$(host_name)
  cat <<EOF
$MARKER: development cluster, $NUM_NODES node(s) on one host. Written by slurm/dev-cluster.sh; edits are overwritten.
ClusterName=launcherdev
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job may start again only after cred_expire+1 s (default 121 s). A launch credential
# must still reach its slurmd within cred_expire s: on one host that takes milliseconds.
AuthInfo=cred_expire=5
SlurmctldPort=6817
StateSaveLocation=$STATE_DIR/ctld
# Several slurmd on one host: each node's spool, PID file and log are its own (%n = node
# name); each node's port and address are on its NodeName line.
SlurmdSpoolDir=$STATE_DIR/spool-%n
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No systemd and no cgroup hierarchy we may write to: track processes through /proc.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
# Declare more CPUs than the machine has so that several small jobs can run at once.
SlurmdParameters=config_overrides
# Impossible requests fail at submit time instead of pending forever.
EnforcePartLimits=ALL
# No accounting daemon (no sacct): keep finished jobs readable with scontrol for an hour.
MinJobAge=3600
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG_DIR/jobcomp.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobRequeue=1
KillWait=30
# A node whose slurmd stops answering is marked DOWN (its jobs end with NODE_FAIL, or requeue)
# after roughly SlurmdTimeout + 2 x MessageTimeout (default 10 s): 25-30 s here instead of over
# 300 s. Not shorter: the silent (SIGSTOPped) node of tests/test_slurm_multinode.py must be DOWN
# well after its peers' collective timeout (15 s); SlurmdTimeout=10 with MessageTimeout=5 gave
# 14-17 s, SlurmdTimeout=5 with MessageTimeout=5 13 s.
SlurmdTimeout=10
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
DependencyParameters=kill_invalid_depend
EOF
  for node in $(node_names); do
    printf 'NodeName=%s NodeHostname=%s NodeAddr=%s Port=%d CPUs=%s RealMemory=%s State=UNKNOWN\n' \
      "$node" "$host" "$(node_addr "$node")" "$((SLURMD_BASE_PORT + ${node#n}))" "$NODE_CPUS" "$(real_memory_mb)"
  done
  printf 'PartitionName=debug Nodes=%s Default=YES MaxTime=INFINITE State=UP\n' "$(node_names | paste -sd, -)"
}

# Node names must resolve (a job's rendezvous endpoint is its first node's name): map each to
# its loopback address in /etc/hosts, on lines tagged with the marker. The file is rewritten
# in place, not renamed over: in containers it is often a bind mount.
map_node_names() {
  local hosts=/etc/hosts kept wanted node
  wanted=$(for node in $(node_names); do printf '%s %s %s\n' "$(node_addr "$node")" "$node" "$MARKER"; done)
  [[ "$(grep -F -- "$MARKER" "$hosts" 2>/dev/null || true)" == "$wanted" ]] && return 0
  kept=$(grep -v -F -- "$MARKER" "$hosts" 2>/dev/null || true)
  printf '%s\n%s\n' "$kept" "$wanted" >"$hosts" || die "could not write $hosts (node names must resolve)"
}

# /etc/slurm/slurm.conf is where the client commands look first. Point it at our config
# unless it belongs to a different (real) installation; then callers use SLURM_CONF.
link_default_conf() {
  local default=/etc/slurm/slurm.conf
  mkdir -p /etc/slurm
  if [[ -L "$default" && "$(readlink "$default")" == "$CONF" ]]; then
    return 0
  fi
  if [[ -e "$default" ]] && ! grep -q "^$MARKER" "$default" 2>/dev/null; then
    log "$default belongs to another SLURM installation; left alone. Use: export SLURM_CONF=$CONF"
    return 0
  fi
  ln -sfn "$CONF" "$default"
}

# --- daemons ------------------------------------------------------------------------------

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munged() {
  if munge_works; then
    return 0 # ours from an earlier `up`, or the machine's own munged: either serves
  fi
  install -d -o munge -g munge -m 0755 "$MUNGE_SOCKET_DIR"
  install -d -o munge -g munge -m 0700 "$MUNGE_DIR" /var/lib/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    log "creating /etc/munge/munge.key"
    install -d -o munge -g munge -m 0700 /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
  fi
  rm -f "$MUNGE_DIR/munged.pid"
  # 9>&-: daemons must not inherit (and hold forever) the lock of take_lock.
  runuser -u munge -- /usr/sbin/munged --force \
    --pid-file="$MUNGE_DIR/munged.pid" --log-file="$MUNGE_DIR/munged.log" 9>&- \
    || die "munged failed to start: see $MUNGE_DIR/munged.log"
  local i
  for ((i = 0; i < 100; i++)); do
    munge_works && return 0
    sleep 0.1
  done
  die "munged started but credentials do not verify after 10 s: see $MUNGE_DIR/munged.log"
}

start_slurmctld() {
  daemon_running slurmctld "$RUN_DIR/slurmctld.pid" && return 0
  rm -f "$RUN_DIR/slurmctld.pid"
  # -i: a state file written by another SLURM version or config is skipped, not fatal.
  slurmctld -i -f "$CONF" 9>&- || die "slurmctld failed to start: see $LOG_DIR/slurmctld.log"
}

start_slurmd() { # start_slurmd NODE
  local node="$1" pidfile
  pidfile=$(slurmd_pidfile "$node")
  daemon_running slurmd "$pidfile" && return 0
  rm -f "$pidfile"
  # -N: this slurmd is node NODE (several share this host).
  slurmd -f "$CONF" -N "$node" 9>&- || die "slurmd of node $node failed to start: see $LOG_DIR/slurmd-$node.log"
}

# Every slurmd PID file in the run folder: this configuration's nodes, those of an earlier `up`
# with more nodes, and the single slurmd.pid of older versions of this script.
all_slurmd_pidfiles() {
  local f
  for f in "$RUN_DIR"/slurmd-*.pid "$RUN_DIR"/slurmd.pid; do
    [[ -e "$f" ]] && printf '%s\n' "$f"
  done
  return 0
}

stop_all_slurmd() {
  local f
  for f in $(all_slurmd_pidfiles); do stop_pid slurmd "$f"; done
}

node_state() { # node_state NODE: e.g. idle, mixed, allocated, down*, drained (empty when unreachable)
  SLURM_CONF="$CONF" sinfo -h -N -n "$1" -o '%T' 2>/dev/null | head -n 1 || true
}

node_ready() { # node_ready NODE
  case "$(node_state "$1")" in idle* | mixed* | allocated* | completing*) return 0 ;; *) return 1 ;; esac
}

wait_nodes_ready() {
  local i node state="" waiting=""
  for ((i = 0; i < START_TIMEOUT_S * 2; i++)); do
    waiting=""
    for node in $(node_names); do
      node_ready "$node" && continue
      waiting+=" $node"
      state=$(node_state "$node")
      case "$state" in
        # A node that was down (killed by a test, or before a restart) returns to service.
        drain* | down* | fail*)
          SLURM_CONF="$CONF" scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true ;;
      esac
    done
    [[ -z "$waiting" ]] && return 0
    sleep 0.5
  done
  die "node(s)$waiting not ready after ${START_TIMEOUT_S} s (last state: '${state:-no answer}'); see $LOG_DIR/slurmctld.log and $LOG_DIR/slurmd-<node>.log"
}

all_up() {
  local node
  munge_works && daemon_running slurmctld "$RUN_DIR/slurmctld.pid" || return 1
  [[ -f "$CONF" ]] && diff -q <(render_conf) "$CONF" >/dev/null 2>&1 || return 1
  for node in $(node_names); do
    daemon_running slurmd "$(slurmd_pidfile "$node")" && node_ready "$node" || return 1
  done
}

# --- commands -----------------------------------------------------------------------------

# Two `up`s at once (two test sessions) must not start two sets of daemons.
take_lock() {
  exec 9>"$STATE_DIR/.lock"
  flock -w 300 9 || die "could not lock $STATE_DIR/.lock within 300 s (another dev-cluster.sh up running?)"
}

cmd_up() {
  if all_up; then
    log "already up ($NUM_NODES node(s): $(node_names | paste -sd' ' -), config $CONF)"
    return 0
  fi
  require_root up
  local t0=$SECONDS node
  mkdir -p "$STATE_DIR" "$RUN_DIR" "$LOG_DIR" "$STATE_DIR/ctld"
  take_lock
  if all_up; then # another `up` finished while we waited for the lock
    log "already up ($NUM_NODES node(s): $(node_names | paste -sd' ' -), config $CONF)"
    return 0
  fi
  install_packages
  local new
  new=$(render_conf)
  if [[ -f "$CONF" ]] && [[ "$new" != "$(cat "$CONF")" ]]; then
    log "configuration changed: restarting slurmctld and slurmd"
    stop_all_slurmd
    stop_pid slurmctld "$RUN_DIR/slurmctld.pid"
  fi
  printf '%s\n' "$new" >"$CONF.tmp" && mv "$CONF.tmp" "$CONF"
  link_default_conf
  map_node_names
  start_munged
  start_slurmctld
  for node in $(node_names); do start_slurmd "$node"; done
  wait_nodes_ready
  log "up in $((SECONDS - t0)) s: $NUM_NODES node(s) $(node_names | paste -sd' ' -) ($NODE_CPUS CPUs each, partition debug), config $CONF"
}

cmd_down() {
  stop_all_slurmd
  stop_pid slurmctld "$RUN_DIR/slurmctld.pid"
  # Only the munged this script started (its PID file is in our folder).
  stop_pid munged "$MUNGE_DIR/munged.pid"
  log "down"
}

# status shows the nodes of the running configuration (the node count is read from it).
configured_nodes() {
  [[ -f "$CONF" ]] && grep -c '^NodeName=' "$CONF" || echo "$NUM_NODES"
}

cmd_status() {
  local ok=0 name pidfile pid state node
  NUM_NODES=$(configured_nodes)
  for name in munged slurmctld; do
    if [[ $name == munged ]]; then pidfile="$MUNGE_DIR/munged.pid"; else pidfile="$RUN_DIR/$name.pid"; fi
    pid=$(pid_of "$pidfile")
    if pid_running "$pid" "$name"; then
      printf '%-10s running (pid %s)\n' "$name" "$pid"
    elif [[ $name == munged ]] && munge_works; then
      printf '%-10s running (not started by this script)\n' "$name"
    else
      printf '%-10s stopped\n' "$name"
      ok=1
    fi
  done
  for node in $(node_names); do
    pid=$(pid_of "$(slurmd_pidfile "$node")")
    state=$(node_state "$node")
    if pid_running "$pid" slurmd; then
      printf '%-10s running (pid %s), node %s %s port %d: %s\n' slurmd "$pid" "$node" "$(node_addr "$node")" \
        "$((SLURMD_BASE_PORT + ${node#n}))" "${state:-no answer}"
    else
      printf '%-10s stopped, node %s: %s\n' slurmd "$node" "${state:-no answer}"
      ok=1
    fi
    node_ready "$node" || ok=1
  done
  printf '%-10s %s\n' config "$CONF"
  return $ok
}

usage() { die "usage: $0 up [--nodes N] | down | status | env"; }

cmd="${1:-}"
(($# > 0)) && shift
while (($# > 0)); do
  case "$1" in
    --nodes) (($# >= 2)) || usage; NUM_NODES="$2"; shift 2 ;;
    --nodes=*) NUM_NODES="${1#--nodes=}"; shift ;;
    *) usage ;;
  esac
done
[[ "$NUM_NODES" =~ ^[0-9]+$ ]] && ((NUM_NODES >= 1 && NUM_NODES <= MAX_NODES)) ||
  die "--nodes $NUM_NODES: need a whole number from 1 to $MAX_NODES (one slurmd per node on this host)"

case "$cmd" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env) printf 'export SLURM_CONF=%q\n' "$CONF" ;;
  *) usage ;;
esac
