#!/usr/bin/env bash
# A real single-node SLURM cluster (munge + slurmctld + slurmd) for development and tests,
# on a Debian/Ubuntu machine without systemd (containers, CI runners, laptops).
#
#   slurm/dev-cluster.sh up       install the packages if missing, write slurm.conf, start the
#                                 daemons (idempotent: returns at once when already up)
#   slurm/dev-cluster.sh down     stop the daemons this script started, by PID
#   slurm/dev-cluster.sh status   show the daemons and the node; exit 0 only when all are up
#   slurm/dev-cluster.sh env      print `export SLURM_CONF=...` (for `eval "$(... env)"`)
#
# Environment:
#   LAUNCHER_SLURM_DIR    folder with the config, state, logs and PID files
#                         (default /var/tmp/launcher-slurm)
#   LAUNCHER_SLURM_CPUS   CPUs the node declares (default 8; more than the machine has is fine:
#                         it lets several small jobs run side by side)
#
# Needs root (package install, munged runs as the munge user, slurmd as root).
# Why each slurm.conf line is there: see docs/slurm.md.
set -euo pipefail

STATE_DIR="${LAUNCHER_SLURM_DIR:-/var/tmp/launcher-slurm}"
NODE_CPUS="${LAUNCHER_SLURM_CPUS:-8}"
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

node_name() { hostname -s; }

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
  local node
  node=$(node_name)
  cat <<EOF
$MARKER: single-node development cluster. Written by slurm/dev-cluster.sh; edits are overwritten.
ClusterName=launcherdev
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job may start again only after cred_expire+1 s (default 121 s).
AuthInfo=cred_expire=10
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/spool
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
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
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
DependencyParameters=kill_invalid_depend
NodeName=$node NodeAddr=127.0.0.1 CPUs=$NODE_CPUS RealMemory=$(real_memory_mb) State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
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

start_slurmd() {
  daemon_running slurmd "$RUN_DIR/slurmd.pid" && return 0
  rm -f "$RUN_DIR/slurmd.pid"
  slurmd -f "$CONF" 9>&- || die "slurmd failed to start: see $LOG_DIR/slurmd.log"
}

node_state() { # prints e.g. idle, mixed, allocated, down*, drained (empty when unreachable)
  SLURM_CONF="$CONF" sinfo -h -n "$(node_name)" -o '%T' 2>/dev/null | head -n 1 || true
}

wait_node_ready() {
  local i state=""
  for ((i = 0; i < START_TIMEOUT_S * 2; i++)); do
    state=$(node_state)
    case "$state" in
      idle* | mixed* | allocated* | completing*) return 0 ;;
      drain* | down | fail*)
        SLURM_CONF="$CONF" scontrol update NodeName="$(node_name)" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
  done
  die "node $(node_name) is not ready after ${START_TIMEOUT_S} s (state: '${state:-no answer}'); see $LOG_DIR/slurmctld.log and $LOG_DIR/slurmd.log"
}

all_up() {
  munge_works &&
    daemon_running slurmctld "$RUN_DIR/slurmctld.pid" &&
    daemon_running slurmd "$RUN_DIR/slurmd.pid" &&
    [[ -f "$CONF" ]] && diff -q <(render_conf) "$CONF" >/dev/null 2>&1 &&
    case "$(node_state)" in idle* | mixed* | allocated* | completing*) true ;; *) false ;; esac
}

# --- commands -----------------------------------------------------------------------------

# Two `up`s at once (two test sessions) must not start two sets of daemons.
take_lock() {
  exec 9>"$STATE_DIR/.lock"
  flock -w 300 9 || die "could not lock $STATE_DIR/.lock within 300 s (another dev-cluster.sh up running?)"
}

cmd_up() {
  if all_up; then
    log "already up (node $(node_name), config $CONF)"
    return 0
  fi
  require_root up
  local t0=$SECONDS
  mkdir -p "$STATE_DIR" "$RUN_DIR" "$LOG_DIR" "$STATE_DIR/ctld" "$STATE_DIR/spool"
  take_lock
  if all_up; then # another `up` finished while we waited for the lock
    log "already up (node $(node_name), config $CONF)"
    return 0
  fi
  install_packages
  local new
  new=$(render_conf)
  if [[ -f "$CONF" ]] && [[ "$new" != "$(cat "$CONF")" ]]; then
    log "configuration changed: restarting slurmctld and slurmd"
    stop_pid slurmd "$RUN_DIR/slurmd.pid"
    stop_pid slurmctld "$RUN_DIR/slurmctld.pid"
  fi
  printf '%s\n' "$new" >"$CONF.tmp" && mv "$CONF.tmp" "$CONF"
  link_default_conf
  start_munged
  start_slurmctld
  start_slurmd
  wait_node_ready
  log "up in $((SECONDS - t0)) s: node $(node_name) ($NODE_CPUS CPUs, partition debug), config $CONF"
}

cmd_down() {
  stop_pid slurmd "$RUN_DIR/slurmd.pid"
  stop_pid slurmctld "$RUN_DIR/slurmctld.pid"
  # Only the munged this script started (its PID file is in our folder).
  stop_pid munged "$MUNGE_DIR/munged.pid"
  log "down"
}

cmd_status() {
  local ok=0 name pidfile pid
  for name in munged slurmctld slurmd; do
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
  local state
  state=$(node_state)
  printf '%-10s %s\n' node "$(node_name): ${state:-no answer}"
  printf '%-10s %s\n' config "$CONF"
  case "$state" in idle* | mixed* | allocated* | completing*) ;; *) ok=1 ;; esac
  return $ok
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env) printf 'export SLURM_CONF=%q\n' "$CONF" ;;
  *) die "usage: $0 up|down|status|env" ;;
esac
