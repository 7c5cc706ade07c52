"""Host cost of one GEMM call on each layer of our stack (H200), and where it goes.

    python3 benchmarks/gemm_host_overhead.py
"""

import cProfile
import io
import pstats

import torch

from inductor_cute import ops
from inductor_cute.host import gemm as host_gemm
from inductor_cute.bench.timing import host_overhead_us, time_us
from inductor_cute.runtime import precompile, stats


def main():
    a = torch.randn(333, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(333, 2048, device="cuda", dtype=torch.bfloat16)
    precompile([ops.gemm_spec_for(a, w.t())])
    ops.mm(a, w.t(), out=out)
    print("loader stats after first call:", dict(stats))
    plan, args, _ = host_gemm._prepare_gemm("mm", a.unsqueeze(0), w.t().unsqueeze(0), None, None, 1.0, None,
                                      "identity", None, out.unsqueeze(0))
    kernel = host_gemm._gemm_kernel(*plan[:3])  # plan[3]: the GEMV's workspace sizes (None here: M=333)
    rows = {
        "torch.mm (cuBLAS)": lambda: torch.mm(a, w.t(), out=out),
        "raw kernel (TVM-FFI)": lambda: kernel(*args),
        "host_gemm._prepare_gemm only": lambda: host_gemm._prepare_gemm("mm", a.unsqueeze(0), w.t().unsqueeze(0), None, None, 1.0,
                                                            None, "identity", None, out.unsqueeze(0)),
        "ops.mm": lambda: ops.mm(a, w.t(), out=out),
    }
    for name, fn in rows.items():
        print(f"{name:28} host {host_overhead_us(fn):7.1f} us/call")
    print(f"device time ops.mm {time_us(lambda: ops.mm(a, w.t(), out=out)):.1f} us, "
          f"cuBLAS {time_us(lambda: torch.mm(a, w.t(), out=out)):.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        ops.mm(a, w.t(), out=out)
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
    print(s.getvalue()[-3500:])


if __name__ == "__main__":
    main()
