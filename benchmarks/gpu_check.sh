#!/bin/bash
# The checks that need a CUDA GPU, in one script (CI has none): the compiled Triton kernel's tests, its
# benchmark, and 20 steps of the embedded demo recipe in bf16 with each sampler. Run from the repo root
# on a GPU machine with otbrl's [trl,dev] dependencies importable; results go to ${OUT:-gpu-check}/.
set -o pipefail
out=${OUT:-gpu-check}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -m pytest -q -p no:cacheprovider -rs tests/core/test_fused_cuda.py tests/core/test_fused.py 2>&1 | tee "$out/pytest.log" | tail -5
python3 benchmarks/bench_fused_gpu.py --out "$out/energy-gpu.md" > "$out/bench.log" 2>&1 || tail "$out/bench.log"
for sampler in otbrl trl; do
  grep -v '^#' otbrl/app/recipes/demo.yaml | sed -e "s|^output_dir: .*|output_dir: /tmp/gpu-demo-$sampler|" \
    -e 's|^max_steps: .*|max_steps: 20|' -e 's|^save_steps: .*|save_steps: 20|' > "/tmp/gpu-demo-$sampler.yaml"
  printf 'bf16: true\nsampler: %s\n' "$sampler" >> "/tmp/gpu-demo-$sampler.yaml"
  python3 -m otbrl.app.cli train --config "/tmp/gpu-demo-$sampler.yaml" > "$out/train-$sampler.log" 2>&1
  echo "train, sampler $sampler: exit $?"; cp "/tmp/gpu-demo-$sampler/summary.json" "$out/summary-$sampler.json"
  cp "/tmp/gpu-demo-$sampler/metrics.jsonl" "$out/metrics-$sampler.jsonl"
done
# the two samplers from one seed: how long their train rewards stay identical, and their step-1 energies
python3 - "$out" <<'PY'
import json, sys
rows = {s: [json.loads(l) for l in open(f"{sys.argv[1]}/metrics-{s}.jsonl")] for s in ("otbrl", "trl")}
same = next((i for i, (a, b) in enumerate(zip(*rows.values())) if a["reward"] != b["reward"]), None)
print(f"train rewards identical for the first {same} steps;",
      "step-1 mean energy", *(f"{s} {r[0]['otb/energy/mean']:.4f}" for s, r in rows.items()))
PY
