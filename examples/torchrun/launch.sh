#!/bin/sh
# One torchrun per node; Swactor tells each node its rank and where rank 0
# listens. PYTHON names the interpreter that has torch (default python3).
set -eu
: "${PYTHON:=python3}"
# One process per GPU on GPU nodes, one on CPU nodes (NPROC_PER_NODE wins).
gpus=${SWACTOR_GPUS_PER_NODE:-0}
[ "$gpus" -gt 0 ] || gpus=1
: "${NPROC_PER_NODE:=$gpus}"
exec "$PYTHON" -m torch.distributed.run \
    --nnodes "$SWACTOR_NUM_NODES" \
    --node_rank "$SWACTOR_NODE_RANK" \
    --nproc_per_node "$NPROC_PER_NODE" \
    --master_addr "$SWACTOR_MASTER_ADDR" \
    --master_port "$SWACTOR_MASTER_PORT" \
    train.py
