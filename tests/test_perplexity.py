"""`inferflow perplexity`: window schemes, the NLL sum equal (exactly) to a plain per-window computation written the
way Hugging Face's strided-perplexity recipe and llama.cpp's perplexity tool define it, agreement with transformers'
own loss, and the CLI on a tiny model folder with a tokenizer."""
import json
import math
import re
from types import SimpleNamespace

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import inferflow
from inferflow.cli import main
from inferflow.errors import InferflowError
from inferflow.eval.perplexity import perplexity, windows
from parity import save
from service_helpers import tiny_llama_ref

VOCAB = 96
GPL = "tests/data/gpl-3.txt"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def ref_and_model(tmp_path_factory):
    ref = tiny_llama_ref(VOCAB, intermediate_size=48)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # sharper than the init, so per-token NLLs differ a lot between contexts
        for p in ref.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    folder = save(ref, tmp_path_factory.mktemp("llama"))
    return ref, inferflow.load(folder, dtype="float32"), folder


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, VOCAB, (300,), generator=torch.Generator().manual_seed(5)).tolist()


def test_windows_score_each_token_once():
    for n, ctx, stride in ((300, 64, 64), (300, 64, 24), (300, 64, 1), (64, 64, 64), (10, 64, 32), (129, 64, 63)):
        ws = windows(n, ctx, stride)
        scored = [t for w in ws for t in range(w.first, w.end)]
        # every token once, in order, but the first; with disjoint windows (stride = ctx) each window's first
        want = [t for t in range(1, n) if stride < ctx or t % ctx]
        assert scored == want, (n, ctx, stride)
        for w in ws:
            assert w.end - w.begin <= ctx and w.begin < w.first
            if w.begin > 0:  # each scored token sees at least ctx - stride tokens before it
                assert w.first - w.begin >= min(ctx - stride, w.end - w.begin - 1)
    assert [(w.begin, w.end, w.first) for w in windows(200, 64, 64, "llamacpp")] == \
        [(0, 64, 33), (64, 128, 97), (128, 192, 161)]  # n // ctx chunks, second halves scored
    for bad in ((100, 1, 1), (100, 8, 9), (100, 8, 0)):
        with pytest.raises(InferflowError):
            windows(*bad)
    with pytest.raises(InferflowError):
        windows(100, 8, 4, "llamacpp")


def _reference_nll(model, ids, ctx, stride, llamacpp=False, bos=None):
    """HF's recipe (labels of already-scored tokens = -100, loss on shifted labels) with full-window logits;
    llamacpp: llama.cpp's disjoint chunks, second half scored, ``bos`` (if any) in each chunk's slot 0."""
    total, count, prev_end = 0.0, 0, 0
    starts = range(0, len(ids) - ctx + 1, ctx) if llamacpp else range(0, len(ids), stride)
    for begin in starts:
        end = min(begin + ctx, len(ids))
        x = torch.tensor(ids[begin:end])
        labels = x.clone()
        if llamacpp:
            x[0] = x[0] if bos is None else bos
            labels[:ctx // 2 + 1] = -100
        else:
            labels[:(end - begin) - (end - prev_end)] = -100
        logp = torch.log_softmax(model.logits(x).double(), dim=-1)[:-1]
        tgt = labels[1:]
        keep = tgt != -100
        nll = -logp[keep].gather(1, tgt[keep][:, None]).squeeze(1)
        total += float(nll.sum())
        count += int(keep.sum())
        prev_end = end
        if end == len(ids):
            break
    return total, count


@pytest.mark.parametrize("ctx,stride", [(64, 64), (64, 24), (50, 17)])
def test_strided_nll_sum_exact(ref_and_model, ids, ctx, stride, no_native):
    # bit-equal sums need the same GEMM for the scored rows as for the full window: the native kernels take calls
    # of <= 16 rows (the head over a short window's scored rows) and round differently from the torch GEMM
    _, m, _ = ref_and_model
    r = perplexity(m, ids, ctx=ctx, stride=stride)
    total, count = _reference_nll(m, ids, ctx, stride)
    assert r.tokens_scored == count == len(ids) - (1 if stride < ctx else math.ceil(len(ids) / ctx))
    assert r.nll_sum == total
    assert r.ppl == math.exp(total / count)


def test_llamacpp_mode_exact(ref_and_model, ids):
    _, m, _ = ref_and_model
    r = perplexity(m, ids, ctx=64, mode="llamacpp")
    assert (r.windows, r.tokens_scored) == (4, 4 * 31)
    assert r.nll_sum == _reference_nll(m, ids, 64, 64, llamacpp=True)[0]
    tok, m.tokenizer = m.tokenizer, SimpleNamespace(add_bos=True, bos_token_id=1)
    try:
        rb = perplexity(m, ids, ctx=64, mode="llamacpp")
    finally:
        m.tokenizer = tok
    assert rb.nll_sum == _reference_nll(m, ids, 64, 64, llamacpp=True, bos=1)[0]
    assert rb.nll_sum != r.nll_sum  # the BOS slot changes the context


def test_matches_transformers_loss(ref_and_model, ids):
    """HF's strided recipe run on transformers' own model (loss * number of valid labels, summed)."""
    ref, m, _ = ref_and_model
    ctx, stride, total, prev_end = 64, 24, 0.0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + ctx, len(ids))
        x = torch.tensor([ids[begin:end]])
        y = x.clone()
        y[:, :-(end - prev_end)] = -100
        with torch.no_grad():
            out = ref(x, labels=y)
        total += float(out.loss) * int((y[:, 1:] != -100).sum())
        prev_end = end
        if end == len(ids):
            break
    r = perplexity(m, ids, ctx=ctx, stride=stride)
    assert r.nll_sum == pytest.approx(total, rel=1e-5)


def test_keep_token_nll_and_progress(ref_and_model, ids):
    _, m, _ = ref_and_model
    calls = []
    r = perplexity(m, ids, ctx=64, stride=32, progress=lambda d, t: calls.append((d, t)), keep_token_nll=True)
    assert calls == [(k + 1, r.windows) for k in range(r.windows)]
    assert len(r.token_nll) == r.tokens_scored and math.isclose(sum(r.token_nll), r.nll_sum, rel_tol=1e-12)


@pytest.fixture(scope="module")
def tokenized_folder(tmp_path_factory):
    """A tiny llama folder with a byte-level BPE tokenizer.json trained on the GPL-3 text."""
    text = open(GPL, encoding="utf-8").read()
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(text.split("\n\n"), trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
                                                                   show_progress=False))
    assert tk.get_vocab_size() <= VOCAB
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    folder = save(transformers.LlamaForCausalLM(cfg).eval(), tmp_path_factory.mktemp("tok"))
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def test_cli(tokenized_folder, capsys):
    m = inferflow.load(tokenized_folder, dtype="float32")
    ids = m.tokenizer.encode(open(GPL, encoding="utf-8").read())[:400]
    want = perplexity(m, ids, ctx=48, stride=16)
    assert main(["perplexity", str(tokenized_folder), GPL, "--ctx", "48", "--stride", "16",
                 "--limit-tokens", "400"]) == 0
    out = capsys.readouterr().out
    got = re.search(r"PPL = ([\d.]+) over (\d+) tokens scored \((\d+) windows", out)
    assert got, out
    assert (float(got[1]), int(got[2]), int(got[3])) == (round(want.ppl, 4), 399, want.windows)
    # load-time quantization through the CLI (q8: close to float)
    assert main(["perplexity", str(tokenized_folder), GPL, "--ctx", "48", "--limit-tokens", "200", "--quant",
                 "q8"]) == 0
    q8 = float(re.search(r"PPL = ([\d.]+)", capsys.readouterr().out)[1])
    base = perplexity(m, ids[:200], ctx=48).ppl
    assert abs(q8 - base) / base < 0.01
    assert main(["perplexity", str(tokenized_folder), "/nonexistent.txt"]) == 2


def test_quant_report_helpers(tmp_path, monkeypatch):
    """tools/quant_report.py: its IQ4_NL decoder equals gguf-py's; the marked doc section is replaced in place."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    monkeypatch.syspath_prepend("tools")
    import quant_report_doc as qr
    from quant_report_files import _iq4_nl

    blocks = np.random.default_rng(0).integers(0, 256, (6, 18), dtype=np.uint8)
    blocks[:, :2] = np.frombuffer(np.float16(np.linspace(-0.5, 0.5, 6)).tobytes(), np.uint8).reshape(6, 2)
    want = dequantize(blocks.reshape(-1), GGMLQuantizationType.IQ4_NL).reshape(6, 32)
    assert np.array_equal(_iq4_nl(torch.from_numpy(blocks)).numpy(), want)
    doc = tmp_path / "q.md"
    qr.write_section(doc, f"{qr.BEGIN}\none\n{qr.END}")
    doc.write_text("# Q\n\n## Formats\nkept\n\n" + doc.read_text().split("\n\n", 1)[1] + "\n## After\nalso kept\n")
    qr.write_section(doc, f"{qr.BEGIN}\ntwo\n{qr.END}")
    text = doc.read_text()
    assert "kept" in text and "also kept" in text and "two" in text and "one" not in text
    assert text.count(qr.BEGIN) == 1
