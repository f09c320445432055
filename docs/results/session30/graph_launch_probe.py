"""Probe: host time of cudaGraphLaunch by node kind (kernels only, + memcpy nodes, + memset nodes)."""
import statistics, time, torch
dev = torch.device("cuda")
x = torch.zeros(4096, device=dev); src = torch.ones(256, 4096, device=dev, dtype=torch.bfloat16)
dst = torch.empty_like(src); big = torch.empty(64, device=dev)
def body(n, memcpy, memset, kcopy):
    for i in range(n):
        x.add_(1.0)
        if i < memcpy: dst.copy_(src)
        if i < kcopy: torch.add(src, 0, out=dst)
        if i < memset: big.zero_()
def launch_ms(g, reps=200):
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize(); t = time.perf_counter(); g.replay(); ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)
for n in (360, 700):
    for memcpy, memset, kcopy in ((0, 0, 0), (1, 0, 0), (2, 0, 0), (5, 0, 0), (0, 0, 2), (0, 40, 0)):
        body(n, memcpy, memset, kcopy); torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body(n, memcpy, memset, kcopy)
        g.replay(); torch.cuda.synchronize()
        print(f"kernels {n} memcpy {memcpy} memset-ops {memset} kernel-copies {kcopy}: launch {launch_ms(g):.3f} ms", flush=True)
