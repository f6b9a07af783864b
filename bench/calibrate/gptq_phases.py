"""GPTQ phases on Llama-3.1-8B shapes under cProfile: python bench/calibrate/gptq_phases.py [SCHEME] [down|gateup]
(one down_proj 4096x14336, or gate+up 2x14336x4096 stacked; bench/calibrate/RESULTS-calibrate.md)."""
import time, sys, torch, cProfile, pstats
from lowbit.algorithms.gptq import gptq_quantize_shared, GPTQOptions
from lowbit.schemes import get_scheme
torch.manual_seed(0)
scheme = get_scheme(sys.argv[1] if len(sys.argv) > 1 else "nvfp4")
spec = scheme.weights
which = sys.argv[2] if len(sys.argv) > 2 else "down"
if which == "down":
    Ws, inw = [torch.randn(4096, 14336) * 0.02], 14336
else:
    Ws, inw = [torch.randn(14336, 4096) * 0.02 for _ in range(2)], 4096
X = torch.randn(2048, inw)
H = X.T @ X
opts = GPTQOptions(scale_search=True)
pr = cProfile.Profile()
t0 = time.perf_counter(); c0 = time.process_time()
pr.enable()
gptq_quantize_shared(Ws, H, spec, options=opts)
pr.disable()
print(f"{which} {sys.argv[1:]} wall {time.perf_counter()-t0:.1f} s cpu {time.process_time()-c0:.1f} s")
pstats.Stats(pr).sort_stats("cumulative").print_stats(18)
