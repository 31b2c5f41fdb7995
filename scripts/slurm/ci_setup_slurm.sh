#!/usr/bin/env bash
# Bring up a one-node Slurm cluster on this machine for the functional Slurm test:
# munge for authentication, slurmctld + slurmd, one partition "ci" holding this node with all
# of its CPUs. Needs root and Debian's slurm-wlm (22.05). Idempotent: a second run finds the
# daemons up and the config unchanged and only waits for the node to be idle.
#
#   sudo bash scripts/slurm/ci_setup_slurm.sh    # then: sinfo, sbatch ...
#
# Daemons run in the background and survive this script (CI owns the machine); stop them with
#   kill "$(cat /run/slurmctld.pid)" "$(cat /run/slurmd.pid)" "$(cat /run/munge/munged.pid)"
set -euo pipefail

SLURM_CONF_DIR=/etc/slurm
NODE_NAME=$(hostname -s)
NODE_CPUS=$(nproc)
PARTITION=ci

if [ "$(id -u)" -ne 0 ]; then
  echo "ci_setup_slurm.sh must run as root (it installs packages and starts daemons)" >&2
  exit 1
fi

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
    return
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge
}

start_munge() {
  install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
  install -d -o munge -g munge -m 0755 /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    # munge wants at least 32 bytes of key; 1024 is what mungekey generates by default.
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    return
  fi
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 1 50); do
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
    sleep 0.1
  done
  echo "munged did not start; see /var/log/munge/munged.log" >&2
  exit 1
}

write_if_changed() {
  # write_if_changed PATH: stdin -> PATH only if different; prints "changed" when it wrote.
  local path=$1 new
  new=$(cat)
  if [ -f "$path" ] && [ "$(cat "$path")" = "$new" ]; then return; fi
  printf '%s\n' "$new" >"$path"
  echo changed
}

write_configs() {
  install -d -m 0755 "$SLURM_CONF_DIR" /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
  local changed=""
  changed+=$(write_if_changed "$SLURM_CONF_DIR/slurm.conf" <<EOF
# Written by scripts/slurm/ci_setup_slurm.sh: one-node CI cluster.
ClusterName=megatron-ci
SlurmctldHost=$NODE_NAME
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
# No cgroup hierarchy is needed (or writable) in CI containers: track processes by parentage.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
# A node that went down (e.g. the machine restarted) comes back by itself when slurmd registers.
ReturnToService=2
# Keep finished jobs visible to "scontrol show job" for 10 minutes (no accounting database).
MinJobAge=600
NodeName=$NODE_NAME NodeAddr=127.0.0.1 CPUs=$NODE_CPUS State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE_NAME Default=YES MaxTime=INFINITE State=UP
EOF
)
  changed+=$(write_if_changed "$SLURM_CONF_DIR/cgroup.conf" <<EOF
CgroupPlugin=cgroup/v1
IgnoreSystemd=yes
EOF
)
  [ -n "$changed" ] && echo changed
  return 0
}

daemon_alive() {
  local pid_file=$1
  [ -s "$pid_file" ] && kill -0 "$(cat "$pid_file")" 2>/dev/null
}

stop_daemon() {
  local pid_file=$1
  if daemon_alive "$pid_file"; then
    kill "$(cat "$pid_file")"
    for _ in $(seq 1 50); do daemon_alive "$pid_file" || return 0; sleep 0.1; done
  fi
}

start_slurm() {
  local config_changed=$1
  if [ -n "$config_changed" ]; then
    stop_daemon /run/slurmd.pid
    stop_daemon /run/slurmctld.pid
  fi
  daemon_alive /run/slurmctld.pid || slurmctld
  daemon_alive /run/slurmd.pid || slurmd
}

wait_for_idle_node() {
  local state=""
  for _ in $(seq 1 120); do
    state=$(sinfo -h -N -n "$NODE_NAME" -o %T 2>/dev/null | head -n1 || true)
    case "$state" in
      idle | mixed | allocated) echo "slurm node $NODE_NAME is $state"; return 0 ;;
      down* | drain* | drained*)
        scontrol update NodeName="$NODE_NAME" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 0.5
  done
  echo "slurm node $NODE_NAME did not become idle (state: '${state:-none}'); see" \
    "/var/log/slurm/slurmctld.log and /var/log/slurm/slurmd.log" >&2
  exit 1
}

install_packages
start_munge
start_slurm "$(write_configs)"
wait_for_idle_node
