"""Peer systems run on the same weights, precision and workload: HF transformers and llama.cpp.

Both are optional (``pip install inferflow[bench]`` plus ``transformers`` / ``llama-cpp-python``) and imported
only when asked for. HF runs ``generate`` (greedy, left-padded batch, EOS off) on a safetensors folder; a GGUF is
first dequantized into one with transformers' ``gguf_file`` loading (kept in ``hf_dir``). llama.cpp runs a GGUF
as-is through llama-cpp-python's low-level ``eval``, one sequence at a time (batch 1 only), greedy argmax.

llama.cpp micro-batches are capped at 16 tokens (``n_batch = n_ubatch = 16``): llama-cpp-python 0.3.16 on an
AVX-512/AMX CPU computed wrong logits for micro-batches of 32 or more tokens (tools/llamacpp_reference.py), so
its prefill here runs in chunks of 16 and is slower than its best.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from ..errors import InferflowError
from .offline import PeerDied, RunSample, sync

LLAMACPP_UBATCH = 16
LLAMACPP_NOTE = ("llama.cpp ran with n_batch = n_ubatch = 16: on this AVX-512 CPU llama-cpp-python computes wrong "
                 "logits for micro-batches of >= 32 tokens, so its prefill runs in 16-token chunks")


def hf_copy(gguf_path: Path, folder: Path) -> Path:
    """Dequantize a GGUF into an HF-layout folder (safetensors, config.json, tokenizer) with transformers."""
    import transformers

    if (folder / "config.json").is_file():
        return folder
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                            dtype=torch.float32)
    ref.hf_quantizer = None  # the dequantized weights are plain tensors; only this bookkeeping blocks saving
    if hasattr(ref.config, "quantization_config"):
        del ref.config.quantization_config
    ref.save_pretrained(folder)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tok.save_pretrained(folder)
    except Exception as e:  # noqa: BLE001 - prompts are token ids; the copy works without a tokenizer
        print(f"(no tokenizer in the HF copy: {type(e).__name__}: {e})", file=sys.stderr)
    return folder


class HFSystem:
    """transformers ``generate``: greedy, batched with left padding, EOS off (exactly n new tokens)."""

    name = "hf"

    def __init__(self, folder: Path, dtype: torch.dtype, device: str):
        try:
            import transformers
        except ImportError as e:
            raise InferflowError("--vs hf needs transformers: pip install transformers") from e
        self.device = device
        self.model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        cfg = self.model.generation_config
        self.pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        # generate() falls back to the model's EOS when the call's config has none: remove it there too
        cfg.eos_token_id = None

    def __call__(self, prompts: list[list[int]], n: int) -> RunSample:
        import transformers

        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        clock = _FirstCall(self.device)
        gen = transformers.GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None,
                                            pad_token_id=self.pad)
        sync(self.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen,
                                      logits_processor=transformers.LogitsProcessorList([clock]))
        sync(self.device)
        t_end = time.perf_counter()
        if out.shape[1] - width != n:
            raise RuntimeError(f"HF generate produced {out.shape[1] - width} tokens per request instead of {n}")
        return RunSample(sum(map(len, prompts)), clock.t - t0, len(prompts) * (n - 1), t_end - clock.t,
                         out[:, width:].tolist())


class _FirstCall:
    """A logits processor that notes when the first logits (the prefill's) arrive."""

    def __init__(self, device: str):
        self.device, self.t = device, None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.t is None:
            sync(self.device)
            self.t = time.perf_counter()
        return scores


class LlamaCppSystem:
    """llama-cpp-python on a GGUF file, in a child process: prefill with ``eval(prompt)``, then one
    ``eval([token])`` per token (timed in the child). A child keeps a llama.cpp crash (seen: an illegal
    instruction in libggml-cpu on this AVX-512/AMX VM, once, mid-benchmark) from taking the benchmark down:
    a dead child raises ``PeerDied`` and the benchmark drops that peer's row."""

    name = "llama.cpp"

    def __init__(self, gguf: Path, n_ctx: int, threads: int):
        import importlib.util
        import multiprocessing as mp

        if importlib.util.find_spec("llama_cpp") is None:
            raise InferflowError("--vs llama.cpp needs llama-cpp-python (pip install llama-cpp-python)")
        if Path(gguf).suffix != ".gguf":
            raise InferflowError("--vs llama.cpp needs a GGUF model file (write one with `inferflow quantize` or "
                                 "gguf-py)")
        ctx = mp.get_context("spawn")  # a fresh interpreter: no torch / OpenMP state shared with llama.cpp
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_llamacpp_worker, args=(child, str(gguf), n_ctx, threads), daemon=True)
        self.proc.start()
        child.close()
        ok, why = self._recv()
        if not ok:
            self.close()
            raise InferflowError(f"llama.cpp cannot load {gguf}: {why}")

    def _recv(self):
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(5)
            raise PeerDied(f"llama.cpp worker died (exit code {self.proc.exitcode})") from None

    def __call__(self, prompts: list[list[int]], n: int) -> RunSample:
        self.conn.send((prompts, n))
        ok, res = self._recv()
        if not ok:
            raise RuntimeError(res)
        return RunSample(*res)

    def memory_mb(self) -> float:
        """The worker's peak resident memory (VmHWM), MiB."""
        try:
            for line in open(f"/proc/{self.proc.pid}/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _llamacpp_worker(conn, gguf: str, n_ctx: int, threads: int) -> None:
    try:
        import llama_cpp
        import numpy as np

        llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_batch=LLAMACPP_UBATCH, n_ubatch=LLAMACPP_UBATCH,
                              n_threads=threads, n_threads_batch=threads, logits_all=False, verbose=False)
    except Exception as e:  # noqa: BLE001 - e.g. a GGUF without the tokenizer metadata llama.cpp requires
        conn.send((False, f"{type(e).__name__}: {e}"))
        return
    conn.send((True, None))
    n_vocab = llm.n_vocab()

    def nxt() -> int:
        return int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,)).argmax())

    while True:
        try:
            prompts, n = conn.recv()
        except EOFError:
            return
        outs, pre_s, dec_s = [], 0.0, 0.0
        for p in prompts:
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(p)
            out = [nxt()]
            t1 = time.perf_counter()
            for _ in range(n - 1):
                llm.eval([out[-1]])
                out.append(nxt())
            dec_s += time.perf_counter() - t1
            pre_s += t1 - t0
            outs.append(out)
        conn.send((True, (sum(map(len, prompts)), pre_s, len(prompts) * (n - 1), dec_s, outs)))

