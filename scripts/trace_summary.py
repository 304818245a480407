"""Summarise a torch.profiler chrome trace of one training iteration whose phases are record_function ranges
`phase:fwd|bwd|step` (scripts/device-trace.py writes such traces):
    python3 scripts/trace_summary.py TRACE.json[.gz]
Per phase: the GPU time per stream, the bytes copied each way, the gaps on the compute stream (the stream with
the most kernel time) and what the host's main thread was doing meanwhile, and where host threads blocked."""
import gzip
import json
import sys
from collections import defaultdict

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATS = {"cpu_op", "python_function", "cuda_runtime", "user_annotation", "cuda_driver"}
# Host calls that wait for the device or the allocator, reported when they take 0.2 ms or more
BLOCKING = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
            "cudaStreamWaitEvent", "cudaHostAlloc", "cudaMalloc", "cudaFree", "cudaHostRegister")


def _union(spans):
    total, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def _gaps(spans, lo, hi, min_us):
    out, cur = [], lo
    for a, b in sorted(spans):
        if a - cur >= min_us:
            out.append((cur, a))
        cur = max(cur, b)
    if hi - cur >= min_us:
        out.append((cur, hi))
    return out


def _short(name: str) -> str:
    if ".py(" in name:  # "path/to/file.py(123): func" -> "file.py:func"
        path, _, rest = name.partition("(")
        return path.rsplit("/", 1)[-1] + ":" + rest.split(": ", 1)[-1]
    return name[:60]


def _stack_at(events, t):
    """The host events of one thread that span time t, outermost first."""
    live = [e for e in events if e["ts"] <= t <= e["ts"] + e["dur"]]
    return sorted(live, key=lambda e: (e["ts"], -e["dur"]))


def _interesting(stack, depth=5):
    names = [_short(e["name"]) for e in stack if e.get("cat") in ("python_function", "cpu_op", "cuda_runtime")]
    names = [n for n in names if not n.startswith(("torch/", "<built-in", "nn.Module", "threading.py"))]
    return " > ".join(names[-depth:])


def summarise(trace: dict, min_gap_ms: float = 0.5, top: int = 8) -> str:
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    phases = [e for e in evs if e.get("cat") == "user_annotation" and e["name"].startswith("phase:")]
    main_tid = phases[0]["tid"] if phases else None
    gpu = [e for e in evs if e.get("cat") in GPU_CATS]
    host = defaultdict(list)
    for e in evs:
        if e.get("cat") in HOST_CATS:
            host[e["tid"]].append(e)
    busy = defaultdict(float)
    for e in gpu:
        if e.get("cat") == "kernel":
            busy[e["tid"]] += e["dur"]
    compute = max(busy, key=busy.get) if busy else None
    lines = []
    for ph in sorted(phases, key=lambda e: e["ts"]):
        lo, hi = ph["ts"], ph["ts"] + ph["dur"]
        lines.append(f"-- {ph['name']}: {ph['dur'] / 1e3:.1f} ms (compute stream {compute})")
        inside = [e for e in gpu if e["ts"] < hi and e["ts"] + e["dur"] > lo]
        by_stream = defaultdict(list)
        for e in inside:
            by_stream[e["tid"]].append((max(lo, e["ts"]), min(hi, e["ts"] + e["dur"])))
        for s, spans in sorted(by_stream.items(), key=lambda kv: -_union(kv[1])):
            lines.append(f"   stream {s}: busy {_union(spans) / 1e3:.1f} ms in {len(spans)} ops")
        copies = defaultdict(lambda: [0, 0.0])
        for e in inside:
            if e.get("cat") == "gpu_memcpy":
                c = copies[e["name"].split(" (")[0]]
                c[0] += int(e.get("args", {}).get("bytes", 0))
                c[1] += e["dur"]
        for name, (nbytes, dur) in sorted(copies.items()):
            lines.append(f"   {name}: {nbytes / 1e9:.2f} GB in {dur / 1e3:.1f} ms of copy time")
        if compute is not None:
            spans = [(e["ts"], e["ts"] + e["dur"]) for e in inside if e["tid"] == compute]
            gaps = _gaps(spans, lo, hi, min_gap_ms * 1e3)
            total = sum(b - a for a, b in gaps)
            lines.append(f"   compute-stream gaps >= {min_gap_ms} ms: {len(gaps)}, {total / 1e3:.1f} ms in all; longest:")
            main = [e for e in host.get(main_tid, []) if e["ts"] < hi and e["ts"] + e["dur"] > lo]
            for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
                what = _interesting(_stack_at(main, (a + b) / 2))
                lines.append(f"     {(b - a) / 1e3:6.2f} ms at +{(a - lo) / 1e3:6.1f}: {what}")
        blocked = defaultdict(lambda: [0, 0.0])
        for tid, all_events in host.items():
            events = [e for e in all_events if e["ts"] < hi and e["ts"] + e["dur"] > lo]
            for e in events:
                if e.get("cat") != "cuda_runtime" or e["dur"] < 200 or not (lo <= e["ts"] < hi):
                    continue
                if not e["name"].startswith(BLOCKING):
                    continue
                caller = _interesting(_stack_at(events, e["ts"] + e["dur"] / 2)[:-1], depth=3)
                key = (("main " if tid == main_tid else f"tid {tid} ") + e["name"], caller)
                blocked[key][0] += 1
                blocked[key][1] += e["dur"]
        if blocked:
            lines.append("   host calls >= 0.2 ms (count, ms):")
            for (name, caller), (n, dur) in sorted(blocked.items(), key=lambda kv: -kv[1][1])[:top]:
                lines.append(f"     {dur / 1e3:7.1f} ms x{n:<4} {name} <- {caller}")
    return "\n".join(lines)


if __name__ == "__main__":
    path = sys.argv[1]
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        print(summarise(json.load(f)))
