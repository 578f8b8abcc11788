#!/usr/bin/env bash
# One lent GPU's round of checks and figures, as one command (device time is scarce: each
# call starts a machine, and a session has minutes). Each part is bounded by its own
# timeout and writes its output under $OUT (default: ./gpu-round), whatever the others do.
#
#   OUT=/some/dir bash benchmarks/gpu_round.sh            (all parts)
#   bash benchmarks/gpu_round.sh check interleaved        (some of them)
#
# Parts: check (gpu_check.py: the CUDA paths), interleaved (the probe's host time per step on
# the demo models, the fixed work alone), parts (gpu_parts.py: each CUDA call's cost), cost
# (gpu_cost.py at batch 32 and at a GPU-bound batch).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-round}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PY:-python3}
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(check interleaved parts cost)
run() {  # name, seconds, command...
    local name=$1 seconds=$2
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S), at most ${seconds} s): $*" | tee -a "$OUT/round.txt"
    timeout "$seconds" "$@" > "$OUT/$name.txt" 2>&1
    echo "=== $name: exit $? ($(date -u +%H:%M:%S))" | tee -a "$OUT/round.txt"
    tail -n 40 "$OUT/$name.txt"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
$PY -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" >> "$OUT/gpu.txt" 2>&1
for part in "${parts[@]}"; do
    case $part in
        check) run check 240 $PY benchmarks/gpu_check.py ;;
        interleaved) run interleaved 200 $PY benchmarks/interleaved.py --device cuda \
            --models tiny,mlp,transformer,cnn --cycles 300 --grad-every 1000000000 ;;
        parts) run parts 90 $PY benchmarks/gpu_parts.py --models mlp --rounds 30 ;;
        cost)
            run cost-32 120 $PY benchmarks/gpu_cost.py --rounds 8
            run cost-8192 120 $PY benchmarks/gpu_cost.py --batch-size 8192 --rounds 6 ;;
        *) echo "gpu_round: no part $part (check, interleaved, parts, cost)" >&2; exit 2 ;;
    esac
done
