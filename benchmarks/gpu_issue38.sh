#!/bin/bash
# What issue 38 still needs from a lent GPU, in one call of about 9 minutes (`run` with timeout_s 590 and
# carry [".whl"]). Here, first: `echo /.whl/ >> .git/info/exclude` and download the wheels the machine lacks
# (python 3.12, manylinux): transformers==5.23.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
# (see the device tool's README). Every part has its own time limit and writes its results under $OUT.
# Third lease: the step's 1.5B rows (every arm, both generation paths: the second lease reached only three)
# and the sampler's whole grid on one machine, after the decode fix (cuDNN attention left out on CUDA).
# The crowd test waits for a lease with time for a first share sized per arm (gpu-crowd.md, try 3).
set -u
out=${OUT:-gpu-issue38}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
# 1. the step at 1.5B: OTB, grpo, dr_grpo and TRL's grpo, TRL generating and otbrl's sampler
timeout 240 python3 benchmarks/bench_gpu_step.py --out "$out/gpu-step.md" --sizes Qwen2.5-1.5B --repeats 1 \
  > "$out/step.log" 2>&1; echo "step exit $?"; grep -E 'repeat|wrote|Error' "$out/step.log" | tail -12
# 2. the sampler against generate, every cell (batch 16 and 64, 256 and 1,024 tokens); the page is written per cell
timeout 290 python3 benchmarks/bench_gpu_sampler.py --out "$out/gpu-sampler.md" > "$out/sampler.log" 2>&1
echo "sampler exit $?"; grep -E 'batch|wrote|Error' "$out/sampler.log" | tail -12
