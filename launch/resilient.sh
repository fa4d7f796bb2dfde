#!/usr/bin/env bash
# Restart a training job after a failure, up to N times; stop on success.
#
#   launch/resilient.sh [--max-restarts N] -- deepspeed examples/gpt/train_gpt.py --deepspeed_config CONFIG ...
#   launch/resilient.sh [--max-restarts N] -- deepspeed --hostfile H examples/gpt/train_gpt.py ...   # on the head node
#
# The job itself finds where the failed attempt got to (cpsr_ds reads its progress
# journal and checkpoints on start), so every attempt runs the same command.
#
# Exit status 78 (sysexits' EX_CONFIG; cpsr_ds.checkpoint.capture.exiting.EXIT_RESTART_CANNOT_HELP)
# means the job stopped at its start because a restart cannot help (no valid state to
# resume from, a disk too full to restore a checkpoint into; its last error says which):
# the script stops with that status instead of restarting. DeepSpeed's launcher
# (`deepspeed --num_gpus N`, and `--hostfile` over pdsh, which returns the largest status
# of the nodes) exits with its failed worker's status. torchrun exits 1 whatever its
# workers' status, so under torchrun the job is restarted all the same.
#
# Each attempt runs in a process group of its own. SIGTERM, SIGINT or SIGHUP to this
# script goes to that whole group (DeepSpeed's launcher, its per-node launchers and
# workers, pdsh and ssh), so nothing of the job outlives the supervisor; DeepSpeed's
# multi-node runner answers it by stopping the launchers on the other nodes over pdsh.
# The script then exits without restarting.
set -u

max_restarts=3
while [ $# -gt 0 ]; do
  case "$1" in
    --max-restarts) max_restarts="$2"; shift 2 ;;
    --max-restarts=*) max_restarts="${1#*=}"; shift ;;
    --) shift; break ;;
    *) break ;;
  esac
done
if [ $# -eq 0 ]; then
  echo "usage: $0 [--max-restarts N] -- COMMAND [ARGS...]" >&2
  exit 2
fi
case "$max_restarts" in
  ''|*[!0-9]*) echo "$0: --max-restarts must be a non-negative integer, got '$max_restarts'" >&2; exit 2 ;;
esac

# A background job gets its own process group only with job control on.
set -m
job=""
stopped=""
stop() {
  stopped="$1"
  [ -n "$job" ] && kill -TERM -- "-$job" 2>/dev/null
}
trap 'stop TERM' TERM
trap 'stop INT' INT
trap 'stop HUP' HUP

cannot_help=78
attempt=0
while true; do
  "$@" &
  job=$!
  # A trapped signal interrupts wait; wait again until the attempt has really exited.
  wait "$job"
  code=$?
  while kill -0 "$job" 2>/dev/null; do
    wait "$job"
    code=$?
  done
  job=""
  if [ -n "$stopped" ]; then
    echo "[resilient] stopped by SIG$stopped; attempt $((attempt + 1)) exited with code $code" >&2
    exit "$code"
  fi
  if [ "$code" -eq 0 ]; then
    [ "$attempt" -gt 0 ] && echo "[resilient] job finished after $attempt restart(s)"
    exit 0
  fi
  if [ "$code" -eq "$cannot_help" ]; then
    echo "[resilient] attempt $((attempt + 1)) exited with code $code: the job says a restart cannot help" \
      "(see its last error); not restarting" >&2
    exit "$code"
  fi
  if [ "$attempt" -ge "$max_restarts" ]; then
    echo "[resilient] attempt $((attempt + 1)) failed with exit code $code; no restarts left ($max_restarts)" >&2
    exit "$code"
  fi
  attempt=$((attempt + 1))
  echo "[resilient] job failed with exit code $code; restart $attempt of $max_restarts"
done
