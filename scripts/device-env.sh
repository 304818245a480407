# Source at the start of every device-machine command (scripts/device-*.sh do):
#   install the carried wheels into /tmp/site and put them and this checkout on PYTHONPATH.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed: run scripts/device-wheels.sh here and carry .whl" >&2; return 1 2>/dev/null || exit 1; }
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
export DS_ACCELERATOR=cuda
# Multicast over NVLink must stay off on the shared multi-GPU hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
dostune() { python3 -m dostune "$@"; }
