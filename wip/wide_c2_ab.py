"""Branch wide-cluster: the register-A wide kernel with K split over a two-CTA cluster (wide_c2,
partials handed over in shared memory, no workspace) against the default plans; bits vs the
Triton decode GEMM. Usage: bash .probe/run.sh python3 .probe/c2_ab.py [bits|speed|both]"""
import sys, torch, triton
sys.path.insert(0, "benchmarks")
from gemm import Shape, bench_us
from minite_common import quantize_nvfp4, nvfp4_gemm
from minite_kernels import w4a4_gemm_cuda as cu
from minite_kernels.w4a4_gemm import decode_config, nvfp4_gemm_sm90
SMS = torch.cuda.get_device_properties(0).multi_processor_count
what = sys.argv[1] if len(sys.argv) > 1 else "both"


def c2(m, n, k, bm):
    return cu.Plan("wide_c2", bm, triton.cdiv(triton.cdiv(k, 512), 2), 2, 2, 1)


def run(a, w, bias, out, how):
    y = torch.empty(a.rows, w.rows, dtype=out, device="cuda")
    cu.gemm(a, w, bias, y, SMS, how=how)
    return y


if what in ("bits", "both"):
    bad = 0
    for n, k in ((1000, 1152), (1000, 640), (2048, 2176), (5120, 2048), (4096, 4096), (384, 512)):
        w = quantize_nvfp4(torch.randn(n, k, device="cuda").bfloat16(), amax="tensor", block_2d=True)
        bias = torch.randn(n, device="cuda").bfloat16()
        for m in (17, 40, 64, 100, 128, 200, 256):
            x = torch.randn(m, k, device="cuda").bfloat16()
            x[m // 2] *= 1e4
            a = quantize_nvfp4(x)
            for out, b in ((torch.bfloat16, None), (torch.float32, bias), (torch.float16, bias)):
                ref = nvfp4_gemm_sm90(a, w, b, out_dtype=out, config=decode_config(m))
                for bm in (32, 64, 128):
                    if bm // 2 >= m and bm > 32:
                        continue
                    got = run(a, w, b, out, c2(m, n, k, bm))
                    ok = torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
                    bad += not ok
                    if not ok:
                        print("MISMATCH", n, k, m, out, bm, (got.float() - ref.float()).abs().max().item(), flush=True)
    print(f"bits: {bad} mismatches", flush=True)

if what in ("speed", "both"):
    shapes = {"8192^2": (8192, 8192), "qkv": (5120, 2048), "o": (2048, 4096), "8B qkv": (6144, 4096),
              "8B o": (4096, 4096), "8B gate/up": (24576, 4096), "8B down": (4096, 12288)}
    for name, (n, k) in shapes.items():
        for m in (32, 64, 128, 256):
            s = Shape(m, n, k)
            default = cu.plan(m, n, k, SMS, ws=cu.ws_fits(s.w_q[0]), wide=True)
            r = {}
            for rep in range(2):
                r["cublas"] = min(r.get("cublas", 1e9), bench_us(s.cublas(), 4))
                r["default"] = min(r.get("default", 1e9), bench_us(s.ours(), 4))
                for bm in (32, 64, 128):
                    if bm // 2 >= m and bm > 32:
                        continue
                    how = c2(m, n, k, bm)
                    r[bm] = min(r.get(bm, 1e9), bench_us(lambda how=how, s=s: [run(s.a_q, w, None, torch.bfloat16, how) for w in s.w_q], 4))
            c = r["cublas"]
            row = " ".join(f"c2/{bm} {r[bm]:6.2f}" for bm in (32, 64, 128) if bm in r)
            best = min(r[bm] for bm in (32, 64, 128) if bm in r)
            print(f"{name:11s} M={m:3d} cuBLAS {c:6.1f} default {default.family}/{default.block_m}/s{default.splits} {r['default']:6.2f} ({c/r['default']:.2f}x) | {row} | best c2 {c/best:.2f}x cuBLAS, {r['default']/best:.2f}x default", flush=True)
            del s; torch.cuda.empty_cache()
