# Sourced by the scripts/gpu_*.sh scripts (from the repository root, with PY set): `require_gpus MIN NAME` sets `gpus`
# to the number of CUDA devices, exits 2 naming NAME when there are fewer than MIN, and prints the devices.
require_gpus() {
  gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
  if [ "$gpus" -lt "$1" ]; then
    echo "$2 needs at least $1 CUDA device(s) (found $gpus)" >&2
    exit 2
  fi
  nvidia-smi --query-gpu=name,memory.total --format=csv
}
