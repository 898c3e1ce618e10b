#!/bin/bash
# What issue 38 still needs from a lent GPU, in one call of about 9 minutes (`run` with timeout_s 590 and
# carry [".whl"]). Here, first: `echo /.whl/ >> .git/info/exclude` and download the wheels the machine lacks
# (python 3.12, manylinux): transformers==5.23.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
# (see the device tool's README). Every part has its own time limit and writes its results under $OUT.
# Third lease (2026-11-28, H200; docs/results/gpu-step.md, gpu-sampler.md): the 1.5B rows and the sampler's
# grid ran, but 4 timed steps a run left a 10% spread between arms doing identical work. Next lease: more
# timed steps (14: six pairs after the warm-up pair) in two repeats, whose page reads the target against that
# spread, then the sampler cell generate did not reach. The crowd test waits for a lease of its own with a
# first share sized per arm (gpu-crowd.md, try 3).
set -u
out=${OUT:-gpu-issue38}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
# 1. the step at 1.5B with six timed pairs a run, two alternated repeats (about 35 s a run, 14 runs)
timeout 400 python3 benchmarks/bench_gpu_step.py --out "$out/gpu-step.md" --sizes Qwen2.5-1.5B --repeats 2 \
  --steps 14 > "$out/step.log" 2>&1; echo "step exit $?"; grep -E 'repeat|wrote|Error' "$out/step.log" | tail -16
# 2. the sampler's 64 x 1,024 cell, which generate did not finish in 130 s
timeout 170 python3 benchmarks/bench_gpu_sampler.py --out "$out/gpu-sampler.md" --cells 64x1024 > "$out/sampler.log" 2>&1
echo "sampler exit $?"; grep -E 'batch|wrote|Error' "$out/sampler.log" | tail -4
