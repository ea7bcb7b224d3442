#!/usr/bin/env bash
# One `accelerate launch` per node of a SLURM job; multi_node.sbatch starts it on every node with srun.
#   srun --ntasks-per-node=1 --cpus-per-task=$SLURM_CPUS_PER_TASK slurm/node_launch.sh recipes/cifar.py --epochs 5
# (pass --cpus-per-task to srun: since SLURM 22.05 it is not inherited from sbatch, and the task would get one core)
# Ranks come from c10d rendezvous at the first node of the allocation, so no node needs to know its own rank.
# Settings (environment): CONFIG (accelerate config, default accelerate_configs/2node.yaml), GPUS_PER_NODE (default:
# the GPUs this node sees), MASTER_ADDR (default: first node of the job), MASTER_PORT (default 29500),
# LAUNCH_ARGS (extra accelerate launch flags), ACCELERATE (the accelerate executable), STARTUP_TIMEOUT (seconds a node
# waits for the others to join, default 300), RESTARTS (restart every worker up to N times when one dies, each time
# from the last checkpoint: multi_node.sbatch adds --resume auto).
set -euo pipefail

: "${SLURM_NNODES:?run this through srun inside an sbatch or salloc allocation (SLURM_NNODES is not set)}"
: "${SLURM_NODEID:?run this through srun inside an sbatch or salloc allocation (SLURM_NODEID is not set)}"
if [ $# -eq 0 ]; then
    echo "usage: srun --ntasks-per-node=1 --cpus-per-task=N $0 <script> [script flags]" >&2
    exit 2
fi

CONFIG=${CONFIG:-accelerate_configs/2node.yaml}
ACCELERATE=${ACCELERATE:-accelerate}
MASTER_PORT=${MASTER_PORT:-29500}
if [ -z "${MASTER_ADDR:-}" ]; then
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
if [ -z "${GPUS_PER_NODE:-}" ]; then
    GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
if [ "${GPUS_PER_NODE:-0}" -lt 1 ]; then
    echo "error: node $(hostname) sees no GPU; request GPUs (#SBATCH --gpus-per-node=8) or set GPUS_PER_NODE" >&2
    exit 2
fi

echo "node $SLURM_NODEID of $SLURM_NNODES ($(hostname)): $GPUS_PER_NODE process(es), rendezvous $MASTER_ADDR:$MASTER_PORT"
# shellcheck disable=SC2086  # LAUNCH_ARGS holds several flags
exec "$ACCELERATE" launch --config_file "$CONFIG" \
    --num_machines "$SLURM_NNODES" --num_processes $((SLURM_NNODES * GPUS_PER_NODE)) \
    --machine_rank "$SLURM_NODEID" --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" \
    --rdzv_backend c10d --rdzv_conf "join_timeout=${STARTUP_TIMEOUT:-300}" \
    ${RESTARTS:+--max_restarts "$RESTARTS"} ${LAUNCH_ARGS:-} "$@"
