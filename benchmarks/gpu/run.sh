#!/usr/bin/env bash
# Every GPU measurement of the project, on one machine with one CUDA GPU:
#
#   benchmarks/gpu/run.sh OUT_DIR [--toy | --dry-run] [--part 1|2|3|quick|all]  (make gpu-bench GPU_OUT=... GPU_PART=...)
#
# On the GPU machine: carry .whl/ (made by benchmarks/gpu/wheels.sh where the package index is
# reachable); this installs it into /tmp/site, checks the GPU (nvidia-smi, torch.cuda), records it
# (OUT_DIR/device.json) and runs python -m benchmarks.gpu.run, which writes NAME.json and NAME.txt into
# OUT_DIR for each measurement and ends with a summary; the exit status is 1 if any failed (the
# others still ran). A measurement whose JSON exists is skipped: run a part cut short again to resume.
# --toy: every measurement at toy sizes on the GPU (about three minutes), a check that the code paths work
# there before the full parts spend their time. --dry-run: the same on the CPU, with the Python in use
# (PYTHON), no wheels.
#
# Parts, each one command of at most 10 minutes on one H100 80 GB (16 cores, 128 GiB, a 64 GB disk
# at ~1.1 GB/s buffered, ~1.8 GB/s O_DIRECT). The times are those measured there on 2026-11-23, with
# the wheels already installed (about 20 s more on a fresh machine); the knobs below change them.
#   1 (5 min) checkpoint_gpt2_0.35b: bench_checkpoint on GPT2-0.35B's state (0.30 B parameters with
#       the byte vocabulary, bf16 + fp32 masters + Adam, ZeRO-1, PP = DP = 1: 4.3 GB), every strategy,
#       GPT2_REPEATS checkpoints each after 2 warm-up ones, beside the raw pinned copy and the disk
#       with fsync (2 GiB probe): 245 s, torch's synchronous save ~10 s of it per checkpoint.
#     recovery_test: tests/jobs/test_recovery.py -k single_process on CUDA (PB-R with bf16 + ZeRO-1,
#       one process; two jobs of the tiny GPT): 49 s.
#   2 (6-7 min) checkpoint_gpt3_3.35b: GPT3-3.35B's layer shape (hidden 4096, 32 heads, seq 2048) with
#       GPT3_LAYERS blocks (4: 0.82 B parameters, 11.4 GB of state; all 16 need ~68 GB of GPU memory
#       before activations and 45 GB per checkpoint on a 64 GB disk), strategies GPT3_STRATEGIES;
#       torch's synchronous save takes 36 s per checkpoint, cpsr's persist 5.3 s.
#     coordinator_test: tests/jobs/test_coordinator_cuda.py (predictor.device cuda: vitp's work on the
#       coordinator's side stream, the compute stream joining it, a PP = 1 job on and off): 31 s on
#       2026-11-27, 4 passed and 1 failed (results/gpu/coordinator_test.txt).
#   3 (7 min) recovery_bench: bench_recovery --quick reduced: a GPT of 8 layers x 768 (57 M
#       parameters, seq 256) on the real corpus, T_c = RECOVERY_TC, 20 intervals, RECOVERY_SEEDS
#       seeds (3 failures each, 2 values of d), methods recompute, trend and the default: 223 s.
#     predictor_footprint: cpsr_ds.predictor.footprint on FOOTPRINT_CHUNKS x 1024 parameters
#       (GPT2-0.35B's count): vitp's host memory and step time: 35 s.
#     restart_gpt2_0.35b: GPT2-0.35B trained with a checkpoint every RESTART_INTERVAL iterations,
#       killed after RESTART_KILL_AT, restarted (PB-R): the predictor's CUDA memory while training
#       and the restart's parts up to the first step: 150 s.
#   quick (at most 8 min, the wheels' installation included: run.py cuts each measurement's timeout to what is
#       left of QUICK_LIMIT_S = 450 s; not yet timed on a GPU) what GPU time is short for:
#     coordinator_test, as in part 2.
#     recovery_gpt2_0.35b: python -m benchmarks.gpu.recovery, bench_recovery --quick at GPT2-0.35B's shape (24 x 1024,
#       16 heads, seq 1024, 0.30 B parameters; bf16, fp32 masters and Adam, ZeRO-1: benchmarks/gpu/gpt2_recovery.json),
#       T_c = GPT2_RECOVERY_TC (20), 20 intervals, GPT2_RECOVERY_SEEDS seeds (1): failures at 25/50/75 % of
#       training with d = T_c/2 and T_c - 1 (6 per seed), recompute, trend and the default, lags by the protocol and
#       the loss excess at f + 4d. Cut to fit: the reference keeps only the checkpoints recoveries read (12 of 20,
#       4.2 GB each, on a 64 GB disk), the recovery cost models are not checked (--no-cost-model: their inputs load
#       8 checkpoints per failure), one seed, validation on GPT2_RECOVERY_VALID (128) sequences. Each failure's cases
#       are appended to OUT_DIR/recovery_gpt2_0.35b.cases.jsonl as they are measured.
#     Not in it (their issues have not landed): the ZeRO-3 recovery test on CUDA ("Any DeepSpeed model") and
#       bench_restart on GPT2-0.35B with the predictor's GPU memory ("Time lost to failures").
# Knobs (environment; defaults in run.py's KNOBS): GPT2_REPEATS GPT2_MICRO GPT2_ACCUM GPT3_LAYERS
# GPT3_REPEATS GPT3_MICRO GPT3_ACCUM GPT3_STRATEGIES RESTART_MICRO RESTART_INTERVAL RESTART_KILL_AT
# FOOTPRINT_CHUNKS RECOVERY_TC RECOVERY_SEEDS RECOVERY_LAYERS RECOVERY_HIDDEN RECOVERY_HEADS
# RECOVERY_SEQ RECOVERY_MICRO RECOVERY_VALID RECOVERY_EVAL_EVERY, and GPT2_RECOVERY_* (TC SEEDS LAYERS HIDDEN HEADS SEQ
# MICRO VALID EVAL_EVERY) and QUICK_LIMIT_S for part quick.
set -euo pipefail

usage="usage: benchmarks/gpu/run.sh OUT_DIR [--toy | --dry-run] [--part 1|2|3|quick|all]"
cd "$(dirname "$0")/../.."
out=""
dry=""
toy=""
part=all
while (( $# )); do
    case "$1" in
        --dry-run) dry=--dry-run ;;
        --toy) toy=--toy ;;
        --part) part=${2:?$usage}; shift ;;
        -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
        -*) echo "run.sh: unknown option $1; $usage" >&2; exit 2 ;;
        *) [[ -z "$out" ]] || { echo "run.sh: one OUT_DIR only; $usage" >&2; exit 2; }; out=$1 ;;
    esac
    shift
done
[[ -n "$out" ]] || { echo "$usage" >&2; exit 2; }
[[ -z "$dry" || -z "$toy" ]] || { echo "run.sh: --toy is on the GPU, --dry-run on the CPU: give one; $usage" >&2; exit 2; }

if [[ -n "$dry" ]]; then
    PYTHON=${PYTHON:-python3}
    export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
    PYTHON=${PYTHON:-python3}
    if ! compgen -G ".whl/*.whl" >/dev/null; then
        echo "run.sh: no wheels in $(pwd)/.whl: run benchmarks/gpu/wheels.sh where the package index is reachable" \
             "and carry .whl to this machine" >&2
        exit 2
    fi
    # Installed once per machine: a later part finds the same wheels installed.
    stamp=/tmp/site/.cpsr-wheels
    if [[ "$(ls -l .whl)" != "$(cat "$stamp" 2>/dev/null)" ]]; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        ls -l .whl > "$stamp"
    fi
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
    if ! nvidia-smi -L; then
        echo "run.sh: nvidia-smi finds no GPU: this is not a GPU machine (--dry-run checks the script on a CPU)" >&2
        exit 2
    fi
    if ! "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
        echo "run.sh: torch $("$PYTHON" -c 'import torch; print(torch.__version__)') sees no CUDA device" >&2
        exit 2
    fi
    # The image's own pytest plugins were built for its pytest, not the carried one.
    export DS_ACCELERATOR=cuda OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
fi
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
exec "$PYTHON" -m benchmarks.gpu.run "$out" $dry $toy --part "$part"
