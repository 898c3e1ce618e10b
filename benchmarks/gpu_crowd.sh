#!/bin/bash
# Many full-length training runs started at the same moment on one CUDA machine, to reproduce (or rule out)
# the start-up crash of issue 38: GPU_RUNS runs of walk3's shape on the GPU (alternately N=4, 16 prompts x 4,
# and N=32, 16 x 32; OTB, GRPO and the group mean in turn) and CPU_RUNS beside them with CUDA hidden, each
# a plain `otbrl train` with its own output folder and log. After LIMIT seconds the runs still going are
# stopped (exit 124: alive, not failed). Every run's log and exit status come back in $OUT/<TAG>-logs.tgz,
# and each failed run's last lines are printed. COLD=1 empties the Triton and inductor caches first (a
# fresh machine's state); PER_RUN_CACHE=1 gives every run a Triton cache of its own; CAP=1 gives every GPU
# run an equal cap on the GPU's memory (OTBRL_GPU_MEMORY_FRACTION = 0.9/GPU_RUNS, as studies' execute does).
set -u
out=${OUT:-gpu-crowd}; tag=${TAG:-crowd}; limit=${LIMIT:-120}; gpu_runs=${GPU_RUNS:-16}; cpu_runs=${CPU_RUNS:-8}
work=$(mktemp -d /tmp/$tag.XXXX); mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 TRL_EXPERIMENTAL_SILENCE=1
[ -n "${COLD:-}" ] && rm -rf ~/.triton/cache /tmp/torchinductor_$(whoami)
arms=(otb grpo dr_grpo)
launch() {  # name index device
  local name=$1 i=$2 where=$3 n=4 batch=64 dir=$work/$1
  if [ $((i % 2)) -eq 1 ]; then n=32 batch=512; fi
  mkdir -p "$dir"
  local env=(); [ "$where" = cpu ] && env+=(CUDA_VISIBLE_DEVICES=)
  [ -n "${PER_RUN_CACHE:-}" ] && env+=(TRITON_CACHE_DIR=$dir/triton-cache)
  [ -n "${CAP:-}" ] && [ "$where" = gpu ] && env+=(OTBRL_GPU_MEMORY_FRACTION=$(awk "BEGIN{printf \"%.4f\", int(9000/$gpu_runs)/10000}"))
  ( env "${env[@]}" timeout "$limit" "${PYTHON:-python3}" -m otbrl.app.cli train --config walk --seed "$i" \
      --advantage_estimator "${arms[$((i % 3))]}" --num_generations $n --per_device_train_batch_size $batch \
      --learning_rate 5e-5 --max_generated_tokens 400000 --max_steps 5000 --eval_size 1024 --eval_before true \
      --save_steps 20 --output_dir "$dir/run" > "$dir/train.log" 2>&1
    echo $? > "$dir/exit" ) &
}
for i in $(seq 0 $((gpu_runs - 1))); do launch gpu$i "$i" gpu; done
for i in $(seq 0 $((cpu_runs - 1))); do launch cpu$i "$i" cpu; done
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv -l 10 > "$work/smi.log" 2>&1 &
smi=$!
wait $(jobs -p | grep -v "^$smi$") 2>/dev/null
kill $smi 2>/dev/null
failed=0
for d in $(ls -d "$work"/gpu* "$work"/cpu* 2>/dev/null); do
  code=$(cat "$d/exit" 2>/dev/null || echo missing)
  steps=$(grep -c "'loss'" "$d/train.log" 2>/dev/null)
  echo "$(basename "$d"): exit $code"
  if [ "$code" != 124 ] && [ "$code" != 0 ]; then
    failed=$((failed + 1)); echo "---- last lines of $(basename "$d")"; tail -25 "$d/train.log"; echo "----"
  fi
done
echo "$tag: $failed of $((gpu_runs + cpu_runs)) runs failed (exit other than 0 or 124) within $limit s"
tar czf "$out/$tag-logs.tgz" -C "$work" --exclude='*/run' --exclude='*/triton-cache' .
