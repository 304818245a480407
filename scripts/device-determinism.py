"""On the GPU machine: is one forward+backward of a preset bit-reproducible? Runs the same batch through the
same weights twice in one process, with PyTorch's deterministic mode off and on, and names the parameters
whose gradients differ. Diagnoses why a resumed GPU run can drift from an uninterrupted one.
    python3 scripts/device-determinism.py [MODEL] [MICRO_BATCH] [SEQ]
"""
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch  # noqa: E402

from dostune.models.registry import loss_of, resolve_model  # noqa: E402

model_name = sys.argv[1] if len(sys.argv) > 1 else "gpt2-1.3b"
mb, seq = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (8, 1024)
spec = resolve_model(model_name)
torch.manual_seed(0)
model = spec.build().to("cuda", torch.bfloat16)
batch = spec.batch(mb, seq, torch.Generator().manual_seed(1), "cuda")


def grads():
    model.zero_grad(set_to_none=True)
    loss_of(model(**batch)).backward()
    torch.cuda.synchronize()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def report(label):
    a, b = grads(), grads()
    c = grads()
    b = b if any(not torch.equal(a[n], b[n]) for n in a) else c  # two chances to catch a race
    diff = [n for n in a if not torch.equal(a[n], b[n])]
    print(f"{label}: {len(diff)} of {len(a)} gradients differ between two identical steps"
          + (f", e.g. {diff[:6]}" if diff else ""))


torch.use_deterministic_algorithms(False)
report("default kernels")
torch.use_deterministic_algorithms(True, warn_only=True)
report("deterministic mode, warn_only=True")
# With warn_only=True PyTorch only warns that flash attention's backward (dq accumulated with atomics) is
# nondeterministic and keeps that kernel; the ordered kernel is picked only in strict mode.
torch.use_deterministic_algorithms(True)
report("deterministic mode, strict")
torch.backends.cuda.preferred_blas_library("cublas")
report("deterministic mode, strict, cuBLAS instead of cuBLASLt")
