#!/bin/bash
# What issue 38 still needs from a lent GPU, in one call of about 9 minutes (`run` with timeout_s 590 and
# carry [".whl"]). Here, first: `echo /.whl/ >> .git/info/exclude` and download the wheels the machine lacks
# (python 3.12, manylinux): transformers==5.23.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
# (see the device tool's README). Every part has its own time limit and writes its results under $OUT.
set -u
out=${OUT:-gpu-issue38}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi -L
# 1. 16 GPU runs (and 8 CPU runs) at once, each GPU run capped at 0.9/16 of the GPU: no failure expected
CAP=1 COLD=1 TAG=capped LIMIT=150 OUT=$out bash benchmarks/gpu_crowd.sh 2>&1 | grep -v ': exit 124$'
# 2. the step without generation (where OTB's work is), both sizes, both samplers, one repeat each
timeout 200 python3 benchmarks/bench_gpu_step.py --out "$out/gpu-step.md" --repeats 1,1 2>&1 | grep -E 'repeat|wrote'
# 3. the sampler's 1,024-token cells (the page is written after every cell)
timeout 170 python3 benchmarks/bench_gpu_sampler.py --out "$out/gpu-sampler.md" --cells 16x1024,64x1024 2>&1 | grep -E 'batch|wrote'
