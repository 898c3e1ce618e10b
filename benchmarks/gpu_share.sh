#!/bin/bash
# One machine's share of an experiment's reported runs, on a CUDA machine: the arms GPU_ARMS at seeds
# GPU_SEEDS on the GPU (GPU_JOBS at a time) and, beside them, CPU_ARMS at CPU_SEEDS on spare CPU cores
# with CUDA hidden (CPU_JOBS at a time). Both are plain `python -m studies compare EXP --arms --seeds`, so the
# protocol check, the gate and the stamps are the usual ones, and each record says where it ran. Finished
# records are bundled into $OUT/records.tgz every 20 s and at the end, so a stop at LIMIT seconds keeps
# every finished run. Untar the bundle in the repository root and commit it: the other machines'
# `python -m studies compare EXP` then skip those runs. Every run's train.log comes back in $OUT/logs.tgz,
# so a failed run's cause is read here. The GPU share's runs each get a cap on the GPU's memory (studies'
# execute: 1.25x each arm's peak measured in committed records from this GPU kind, fewer at once if they
# do not fit; else 0.9/GPU_JOBS each, which starves larger arms: docs/results/gpu-crowd.md, try 3).
# QUICK=1 runs the experiment's --quick version (a dry run).
set -u
exp=${EXP:?EXP: the experiment}; out=${OUT:-gpu-share}; limit=${LIMIT:-540}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
quick=${QUICK:+--quick}
records=docs/results/runs/$exp; [ -n "$quick" ] && records=runs/compare-quick/results/runs/$exp
# PILOT=1: the experiment's pilot (`compare --pilot --arms`, every pilot seed; seeds whose arms trained
# on another kind of machine are refused with a line saying so)
[ -n "${PILOT:-}" ] && records=docs/results/runs/$exp-pilot
marker=$(mktemp); start=$SECONDS
bundle() {
  find "$records" -name 'seed*.json.gz' -newer "$marker" 2>/dev/null | sort > "$out/.list"
  tar czf "$out/.records.tgz" -T "$out/.list" && mv "$out/.records.tgz" "$out/records.tgz"
}
nvidia-smi -L 2>/dev/null || echo "no GPU: the GPU share runs on the CPU"
share() {  # name arms seeds jobs [env...]
  local name=$1 arms=$2 seeds=$3 jobs=$4; shift 4
  [ -n "$arms" ] || return 0
  local which=(--seeds "$seeds"); [ -n "${PILOT:-}" ] && which=(--pilot)
  env "$@" timeout "$limit" python3 -m studies compare "$exp" $quick --arms "$arms" "${which[@]}" \
    --jobs "$jobs" --runs-dir "runs/share-$name/$exp" > "$out/$name.log" 2>&1
  echo "$name share: exit $? after $((SECONDS - start)) s"
}
share gpu "${GPU_ARMS:-}" "${GPU_SEEDS:-}" "${GPU_JOBS:-4}" &
share cpu "${CPU_ARMS:-}" "${CPU_SEEDS:-}" "${CPU_JOBS:-4}" CUDA_VISIBLE_DEVICES= &
while [ -n "$(jobs -r)" ]; do bundle; sleep 20; done
wait; bundle
find runs/share-gpu runs/share-cpu -name train.log 2>/dev/null | tar czf "$out/logs.tgz" -T - 2>/dev/null
echo "records finished here: $(wc -l < "$out/.list")"; sed 's|^|  |' "$out/.list"
# one line per run: arm, seed, where it ran, train seconds, held-out at the end (the bundle holds the rest)
python3 - "$out/.list" <<'PY'
import gzip, json, sys
for path in open(sys.argv[1]).read().split():
    r = json.load(gzip.open(path))
    s, env = r["summary"], r.get("environment") or {}
    print(f"  {r['arm']} seed {r['seed']}: {env.get('device')}, torch {env.get('torch')}, "
          f"{s.get('train seconds')} s, held-out {s.get('held-out reward before')} -> {s.get('held-out reward after')}"
          + (f", peak GPU memory {s['peak GPU memory (GiB)']} GiB" if "peak GPU memory (GiB)" in s else ""))
PY
