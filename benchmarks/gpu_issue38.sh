#!/bin/bash
# What issue 38 still needs from a lent GPU, in one call of about 9 minutes (`run` with timeout_s 590 and
# carry [".whl"]). Here, first: `echo /.whl/ >> .git/info/exclude` and download the wheels the machine lacks
# (python 3.12, manylinux): transformers==5.23.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
# (see the device tool's README). Every part has its own time limit and writes its results under $OUT.
# The second lease (gpu-crowd.md, try 3) showed equal caps fail walk's N=32 arms; the crowd test waits for
# caps sized per arm, so this lease measures the decoding fix and the step's 1.5B rows instead.
set -u
out=${OUT:-gpu-issue38}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi -L
# 1. decode without cuDNN attention against generate, per 128-step bucket (the fix of gpu-decode-profile.md)
timeout 170 python3 benchmarks/gpu_decode_profile.py 1024 2>&1 | grep -E 'attention|decode|generate' | head -8
# 2. the sampler's 1,024-token cell, each contender warmed up over the whole length
timeout 150 python3 benchmarks/bench_gpu_sampler.py --out "$out/gpu-sampler.md" --cells 16x1024 2>&1 | grep -E 'batch|wrote'
# 3. the step's 1.5B rows the second lease did not reach (OTB, and otbrl's sampler)
timeout 200 python3 benchmarks/bench_gpu_step.py --out "$out/gpu-step.md" --sizes Qwen2.5-1.5B --repeats 1 2>&1 | grep -E 'repeat|wrote'
