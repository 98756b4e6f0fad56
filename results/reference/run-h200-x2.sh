#!/usr/bin/env bash
# How the reference results under results/reference/h200-x2/ were produced: on the lent 2xH200
# node (no package registry), from the repository root, with .whl/ (DeepSpeed 0.19.8 and 0.19.6
# wheels, pydantic & co. for Python 3.12) and .debs/ (libaio1, libaio-dev) carried along.
#   bash results/reference/run-h200-x2.sh base   # reports, ops (arch as set, then 9.0), profile, collectives
#   bash results/reference/run-h200-x2.sh zero [PYTEST ARGS]  # the ZeRO suite on the GPUs
# Everything lands in $OUT (one log and one tarball per part).
set -uo pipefail
part=${1:?usage: run-h200-x2.sh base|zero [PYTEST ARGS]}
shift
budget_s=${DSCONFORM_BUDGET_S:-520}
out=${OUT:-/tmp/dsconform-out}
mkdir -p "$out"
exec > >(tee "$out/$part.log") 2>&1
res=/tmp/dsconform-results/$part
mkdir -p "$res"
export PYTHONUNBUFFERED=1 DSCONFORM_CACHE=$PWD/.cache/dsconform  # kept between calls (ignored path)
source examples/offline-node.sh .debs .whl/ds198 .whl/deps || exit 1
pytest=(python3 -m pytest -p no:cacheprovider -rfEs)
budget() { timeout -s INT -k 20 "$@"; }  # SIGINT: pytest still writes its results

if [ "$part" = base ]; then
    nvidia-smi > "$res/nvidia-smi.txt" 2>&1
    python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), torch.cuda.device_count())'
    echo "TORCH_CUDA_ARCH_LIST as the machine sets it: ${TORCH_CUDA_ARCH_LIST-<unset>}"
    python3 -m deepspeed.env_report > "$res/ds_report-h200-0.19.8.txt" 2>&1
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site196 .whl/ds196/*.whl
    PYTHONPATH=/tmp/site196:$PYTHONPATH python3 -m deepspeed.env_report > "$res/ds_report-h200-0.19.6.txt" 2>&1
    python3 -m dsconform.cli detect > "$res/detected.toml"
    echo "== ops with TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST-}"
    budget 110 "${pytest[@]}" suites/test_ops.py --profile h200-x2 --results "$res/ops-arch-as-set"
    export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
    echo "== building ops in parallel with TORCH_CUDA_ARCH_LIST=9.0"
    pids=()
    for op in fused_adam cpu_adam async_io gds; do
        python3 -c "from dsconform.ops import load_op; r = load_op('$op'); print('$op', r.loaded, round(r.seconds, 1), r.error)" &
        pids+=($!)
    done
    wait "${pids[@]}"  # not a bare wait: that also waits for the tee behind exec
    echo "== the suite, -m gpu, without zero"
    budget 280 "${pytest[@]}" suites -m gpu --profile h200-x2 --results "$res/gpu" \
        --ignore suites/test_zero.py
else
    export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
    budget "$budget_s" "${pytest[@]}" suites/test_zero.py -m gpu --profile h200-x2 \
        --results "$res/zero" "$@"
fi
tar -C /tmp/dsconform-results -czf "$out/$part.tgz" "$part"
