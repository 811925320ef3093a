#!/usr/bin/env bash
# hpckpt.dist's accelerator paths on a machine with one GPU (the job: bench/cuda_job.py).
# Run from the repository root on that machine; the reports go to $OUT (default /tmp/cuda-out):
#   nccl.json  one rank, nccl: 1 GiB of device DTensors saved, async-saved, loaded, against torch DCP
#   gloo.json  two ranks on the one GPU, gloo, device tensors (pinned staging with several ranks)
#   exits.txt  12 short nccl jobs ending in destroy_process_group() and a normal exit: rc of each
# It uses the machine's own python3 and torch (hpckpt's dependencies are there: numpy, typer,
# rich, safetensors, xxhash) and hpckpt from this checkout through PYTHONPATH, installing nothing.
set -u
OUT=${OUT:-/tmp/cuda-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
pkg=$(mktemp -d) && ln -s "$PWD" "$pkg/hpckpt" && export PYTHONPATH=$pkg
W=$(mktemp -d)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, numpy, hpckpt.dist; print('torch', torch.__version__, 'numpy', numpy.__version__, 'cuda', torch.cuda.is_available())"
job() { torchrun --standalone --nproc-per-node "$1" bench/cuda_job.py "${@:2}"; }
job 1 --backend nccl --size-gib 1 --rounds 2 --work "$W/n" --report "$OUT/nccl.json"; echo "nccl job rc=$?"
job 2 --backend gloo --size-gib 0.25 --rounds 1 --work "$W/g" --report "$OUT/gloo.json"; echo "gloo job rc=$?"
: > "$OUT/exits.txt"
for i in $(seq 12); do
  job 1 --backend nccl --size-gib 0.01 --rounds 1 --work "$W/e" --report "$W/e.json" > "$W/e.log" 2>&1
  rc=$?; echo "$rc" >> "$OUT/exits.txt"; [ "$rc" -ne 0 ] && tail -5 "$W/e.log"
done
echo "exit codes of 12 nccl jobs: $(sort "$OUT/exits.txt" | uniq -c | tr '\n' ' ')"
rm -rf "$W"
