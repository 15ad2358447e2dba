#!/usr/bin/env bash
# Runs CMD as N processes of one JAX distributed runtime on this machine, as N hosts would run it:
#
#   bash launch/local_cluster.sh N CMD...
#   bash launch/local_cluster.sh 2 python -m launch.train --config configs/tiny.py --workdir runs/mh
#
# Process i gets CMD plus --config.distributed.{coordinator_address,num_processes,process_id}
# (coordinator on 127.0.0.1, a free port unless LOGRA_COORDINATOR_PORT is set) and
# LOGRA_HOST_DEVICES CPU devices (default 4; CPU collectives between processes go through gloo).
# Process 0 prints to this terminal; process i > 0 to $LOGRA_CLUSTER_LOGS/process_i.log
# (default: a temporary folder, named at the start). When one process fails, the others are
# stopped and the exit status is that of the first to fail.
set -euo pipefail

if [[ $# -lt 2 || ! "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: bash launch/local_cluster.sh N CMD... (N ≥ 1 processes)" >&2
  exit 2
fi
n=$1
shift
port=${LOGRA_COORDINATOR_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
logs=${LOGRA_CLUSTER_LOGS:-$(mktemp -d -t logra_cluster.XXXXXX)}
mkdir -p "$logs"
export LOGRA_HOST_DEVICES=${LOGRA_HOST_DEVICES:-4}
echo "local cluster: $n processes × $LOGRA_HOST_DEVICES devices, coordinator 127.0.0.1:$port, logs in $logs" >&2

declare -A index_of   # pid → process id, for the processes still running
for ((i = 0; i < n; i++)); do
  args=("$@" "--config.distributed.coordinator_address=127.0.0.1:$port"
        "--config.distributed.num_processes=$n" "--config.distributed.process_id=$i")
  if ((i == 0)); then
    "${args[@]}" &
  else
    "${args[@]}" >"$logs/process_$i.log" 2>&1 &
  fi
  index_of[$!]=$i
done

stop_all() { kill "${!index_of[@]}" 2>/dev/null || true; }
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM

# The first process to fail stops the others (they would otherwise wait for it in a collective
# until JAX's heartbeat timeout).
status=0
while ((${#index_of[@]} > 0)); do
  set +e
  wait -n -p done_pid "${!index_of[@]}"
  rc=$?
  set -e
  i=${index_of[$done_pid]}
  unset "index_of[$done_pid]"
  if ((rc != 0 && status == 0)); then
    status=$rc
    if ((rc == 130 || rc == 143)); then
      # Stopped by a signal with a checkpoint: the others stop after the same step by themselves
      # (and a second signal would cut their exit short).
      echo "local cluster: process $i was stopped (status $rc); waiting for the others" >&2
    else
      echo "local cluster: process $i exited with status $rc; stopping the others" >&2
      stop_all
    fi
  fi
done
exit $status
