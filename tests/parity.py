"""Shared checks: a tiny random HF reference model vs the same weights loaded by inferflow."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

import inferflow

LENGTHS = (7, 11)
# INFERFLOW_TEST_DEVICE=cuda runs the same parity checks with inferflow on the GPU (reference stays on CPU)
DEVICE = os.environ.get("INFERFLOW_TEST_DEVICE", "cpu")


def close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    tol = 1e-4 * ref.abs().max().item() + 1e-5
    diff = (ours.detach().cpu().float() - ref.float()).abs().max().item()
    assert diff <= tol, f"{what}: max |diff| {diff:.3g} > tolerance {tol:.3g}"


def save(ref: torch.nn.Module, tmp: Path | None = None) -> Path:
    folder = Path(tmp or tempfile.mkdtemp(prefix="inferflow-ref-"))
    ref.save_pretrained(folder, safe_serialization=True)
    return folder


def sequences(vocab: int, seed: int = 0, lengths=LENGTHS, low: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (n,), generator=g).tolist() for n in lengths]


def check_decoder(ref: torch.nn.Module, folder: Path, vocab: int, **load_kw) -> inferflow.Model:
    """Batched ragged logits and incremental (KV-cache) logits equal the reference run per sequence."""
    # quantized (GGUF) weights: the bit-exact reference kernels; the fast int4 path is bf16-accurate and is
    # checked against them in tests/test_cpu_kernels.py
    m = inferflow.load(folder, device=DEVICE, **{"dtype": "float32", "quant_kernels": "reference", **load_kw})
    seqs = sequences(vocab)
    ours = m.logits(seqs)
    assert ours.shape == (len(seqs), max(LENGTHS), vocab)
    for b, s in enumerate(seqs):
        with torch.no_grad():
            r = ref(torch.tensor([s])).logits[0].float()
        close(ours[b, :len(s)], r, f"{m.spec.name} batch row {b}")
        close(m.logits(s), r, f"{m.spec.name} single sequence {b}")
        close(m.incremental_logits(s), r, f"{m.spec.name} incremental {b}")
        close(m.incremental_logits(s, chunk=3), r, f"{m.spec.name} chunked incremental {b}")
    return m


def check_seq2seq(ref: torch.nn.Module, folder: Path, vocab: int, start: int = 0) -> inferflow.Model:
    m = inferflow.load(folder, device=DEVICE, dtype="float32")
    enc = sequences(vocab, seed=1)
    dec = [[start] + s[:-1] for s in sequences(vocab, seed=2, lengths=(5, 9))]
    ours = m.logits(dec, encoder_input_ids=enc)
    for b in range(2):
        with torch.no_grad():
            r = ref(input_ids=torch.tensor([enc[b]]), decoder_input_ids=torch.tensor([dec[b]])).logits[0].float()
        close(ours[b, :len(dec[b])], r, f"{m.spec.name} batch row {b}")
        close(m.incremental_logits(dec[b], encoder_input_ids=enc[b]), r, f"{m.spec.name} incremental {b}")
    return m


def check_encoder(ref: torch.nn.Module, folder: Path, vocab: int, *, logits: bool) -> inferflow.Model:
    """Encoder-only: last hidden states (base models) or MLM logits, with padding in the batch."""
    m = inferflow.load(folder, device=DEVICE, dtype="float32")
    seqs = sequences(vocab)
    ours = m.logits(seqs) if logits else m.hidden_states(seqs)
    for b, s in enumerate(seqs):
        with torch.no_grad():
            out = ref(torch.tensor([s]))
            r = (out.logits if logits else out.last_hidden_state)[0].float()
        close(ours[b, :len(s)], r, f"{m.spec.name} row {b}")
    return m
