"""Default-model decode tok/s, interleaved: float32 (every weight dequantized) vs f32 layers + the file's Q8_0 head
vs q4 vs q8 (int4 planes) vs q8 on the chunked int8 decoder (the path before the planes: int4 refused for Q8_0).

    PYTHONPATH=. python tools/bench_decode_q8.py [tokens=16] [rounds=3]
"""
import statistics, sys, time
import torch
import inferflow
from inferflow.default_model import default_model_path
from inferflow.quant import ggml, int4pack

torch.set_num_threads(1)
path = default_model_path()
models = {}
from inferflow.components.linear import Linear
from inferflow.components.embeddings import TokenEmbedding
saved = Linear.load_packed, TokenEmbedding.load_packed
Linear.load_packed = TokenEmbedding.load_packed = lambda self, name, t, dtype: False  # every weight float32
try:
    models["float32"] = inferflow.load(path, quant="f32")
finally:
    Linear.load_packed, TokenEmbedding.load_packed = saved
for name, q in (("f32+q8head", "f32"), ("q4", "q4"), ("q8", "q8")):
    models[name] = inferflow.load(path, quant=q)
supports = int4pack.supports  # the chunked int8 decoder, as before this change
int4pack.supports = lambda qtype, shape: qtype != ggml.Q8_0 and supports(qtype, shape)
try:
    models["q8-chunked"] = inferflow.load(path, quant="q8")
finally:
    int4pack.supports = supports
for n, m in models.items():
    print(n, sorted({k for mod in m.net.modules() for k in (getattr(mod, "kernels", None) or {}).values()}))
tok = models["q8"].tokenizer
ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
T = int(sys.argv[1]) if len(sys.argv) > 1 else 16
res = {n: [] for n in models}
for m in models.values():
    m.generate_ids(ids, max_new_tokens=2, stop_ids=set())
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 3):
    for n, m in models.items():
        t0 = time.perf_counter(); m.generate_ids(ids, max_new_tokens=1, stop_ids=set())
        t1 = time.perf_counter(); m.generate_ids(ids, max_new_tokens=T, stop_ids=set())
        t2 = time.perf_counter()
        res[n].append(((t2 - t1) - (t1 - t0)) / (T - 1))
med = {n: statistics.median(v) for n, v in res.items()}
for n in models:
    print(f"{n:11s} {1 / med[n]:6.1f} tok/s  ({med[n] * 1e3:6.1f} ms/token)  vs float32 x{med['float32'] / med[n]:.2f}")
