#!/usr/bin/env bash
# Nightly cluster acceptance without Slurm: pdsh starts the suite on every node, torchrun runs
# the multi-node tier. Run it on a login node that reaches the nodes by ssh:
#   NODES=gpu-a01,gpu-a02,gpu-a03 examples/nightly-pdsh.sh
# Stage 0: `dsconform build-ops` on the first node builds the ops into the shared op cache
#          (CACHE), once for every node.
# Stage 1: the single-node suite (`pytest suites -m gpu`) on every node at once, each node into
#          its own folder under a shared results directory.
# Stage 2: the multi-node tier (`pytest suites -m multinode`): one torchrun agent per node,
#          one rank per GPU, rendezvous through torchrun's c10d store on the first node; every
#          pytest process joins it as one rank (dsconform/harness/api.py, external rendezvous).
# Stage 3: `dsconform aggregate`: one report, and PRINTED (never run) drain commands for the
#          failing nodes (Slurm's scontrol syntax: adapt them to your scheduler).
# Exit status: aggregate's (0 every node passed, 1 a node failed, 2 unusable input).
set -uo pipefail

# --- settings: CHANGE these -------------------------------------------------------------------
NODES=${NODES:?set NODES=host1,host2,... (the nodes to accept tonight)}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}          # one rank per GPU in stage 2
SUITE=${SUITE:-/shared/dsconform}          # the checkout, the same path on every node
SHARED=${SHARED:-/shared/dsconform-results}  # results, the same path on every node
PROFILE=${PROFILE:-h200-x8}                # the node type's hardware profile
BUNDLE=${BUNDLE:-}                         # air-gapped nodes: the `dsconform bundle` folder
PYTHON=${PYTHON:-python3}                  # the nodes' Python that holds torch
CACHE=${CACHE:-$SHARED/op-cache}           # the op cache, on a filesystem every node mounts
PORT=${PORT:-29400}                        # torchrun's rendezvous port on the first node
STAGE1_S=${STAGE1_S:-3600}
STAGE2_S=${STAGE2_S:-1800}
OUTLIER_PCT=${OUTLIER_PCT:-90}
export PDSH_RCMD_TYPE=${PDSH_RCMD_TYPE:-ssh}
# Site NCCL settings (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...) go into ENV below: pdsh does not
# carry this shell's environment to the nodes.
ENV="DSCONFORM_PROFILE=$PROFILE DSCONFORM_BUNDLE=$BUNDLE DSCONFORM_CACHE=$CACHE PYTHON=$PYTHON"
# ----------------------------------------------------------------------------------------------

run=$SHARED/$(date +%Y-%m-%d-%H%M)
mkdir -p "$run/single" "$run/multinode" || exit 2
head=${NODES%%,*}
nnodes=$(tr ',' '\n' <<< "$NODES" | grep -c .)
echo "dsconform nightly: $nnodes nodes ($NODES); results in $run"

# Stage 0: the ops, built once into the shared cache (a failed build is reported in stage 1).
pdsh -w "$head" "env $ENV $SUITE/examples/nightly-node.sh build-ops $run"
echo "dsconform nightly: stage 0 (build-ops) done (pdsh exit $?)"

# Stage 1: every node at once; a failing node must not stop the others.
pdsh -w "$NODES" "env $ENV DSCONFORM_TIME_S=$STAGE1_S $SUITE/examples/nightly-node.sh single \
$run/single"
echo "dsconform nightly: stage 1 done (pdsh exit $?)"

# Stage 2: one torchrun agent per node; --no-python runs nightly-node.sh once per rank, with
# RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set by torchrun.
pdsh -w "$NODES" "cd $SUITE && env $ENV DSCONFORM_TIME_S=$STAGE2_S $PYTHON -m torch.distributed.run \
--nnodes=$nnodes --nproc-per-node=$GPUS_PER_NODE --rdzv-backend=c10d \
--rdzv-endpoint=$head:$PORT --rdzv-id=dsconform-$(basename "$run") --max-restarts=0 \
--no-python $SUITE/examples/nightly-node.sh rank $run/multinode"
echo "dsconform nightly: stage 2 done (pdsh exit $?)"

# Stage 3: one report; a node that wrote nothing fails too (--expect).
cd "$SUITE" || exit 2
if [ -n "$BUNDLE" ]; then source "$BUNDLE/install.sh" > /dev/null; fi
"$PYTHON" -m dsconform.cli aggregate "$run/single" "$run/multinode" --expect "$NODES" \
    --outlier-pct "$OUTLIER_PCT" --out "$run/cluster"
status=$?
echo "dsconform nightly: report $run/cluster/cluster.md (aggregate exit $status)"
exit $status
