"""On the GPU machine: host<->device copy rates from host memory pinned three ways, as the GPU lane copies (three
100M-byte-class tensors per subgroup, 25M fp32 elements each):
  alloc     torch's pinned allocator (cudaHostAlloc; what `dostune profile` measures)
  register  ordinary torch memory page-locked in place with cudaHostRegister (how dostune pins DeepSpeed's states)
  huge      like register, but allocated 2 MiB-aligned with madvise(MADV_HUGEPAGE) first (transparent huge pages)
    python3 scripts/device-pinned-copy.py [ELEMENTS]"""
import ctypes
import mmap
import sys
import time

import torch

libc = ctypes.CDLL(None, use_errno=True)
MADV_HUGEPAGE = 14


def huge_tensor(n: int) -> torch.Tensor:
    nbytes = (n * 4 + (2 << 20) - 1) // (2 << 20) * (2 << 20)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), MADV_HUGEPAGE)
    t = torch.frombuffer(buf, dtype=torch.float32, count=n)
    t.fill_(1.0)  # fault the pages in
    t._keep = buf
    return t


def make(kind: str, n: int) -> torch.Tensor:
    if kind == "alloc":
        return torch.ones(n, pin_memory=True)
    t = huge_tensor(n) if kind == "huge" else torch.ones(n)
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * 4, 0)
    assert int(rc) == 0, rc
    return t


def rate(fn, nbytes: int, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


def main() -> None:
    n = int(float(sys.argv[1])) if len(sys.argv) > 1 else 25_000_000
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    except OSError:
        thp = "?"
    print(f"transparent_hugepage: {thp}", flush=True)
    dev = [torch.empty(n, device="cuda") for _ in range(3)]
    s_in, s_out = torch.cuda.Stream(), torch.cuda.Stream()
    for kind in ("alloc", "register", "huge", "alloc", "register", "huge"):
        host = [make(kind, n) for _ in range(3)]
        back = [make(kind, n) for _ in range(3)]

        def h2d():
            with torch.cuda.stream(s_in):
                for d, h in zip(dev, host):
                    d.copy_(h, non_blocking=True)

        def d2h():
            with torch.cuda.stream(s_out):
                for d, h in zip(dev, back):
                    h.copy_(d, non_blocking=True)

        def both():
            h2d()
            d2h()

        nbytes = 3 * n * 4
        print(f"{kind:8}: H2D {rate(h2d, nbytes):5.1f} GB/s, D2H {rate(d2h, nbytes):5.1f} GB/s, "
              f"both at once {rate(both, nbytes):5.1f} GB/s each way", flush=True)
        for t in host + back:
            if kind != "alloc":
                torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


if __name__ == "__main__":
    main()
