"""llama2.c checkpoints (v0, v1, v2 .bin and training .pt) and tokenizer.bin, written in-test like export.py."""
import copy
import io
import struct

import numpy as np
import pytest
import torch
import transformers

import inferflow
from inferflow.errors import FormatError
from inferflow.loaders import open_file
from inferflow.loaders.llama2c import Llama2cSource
from inferflow.tokenizers.llama2c import Llama2cTokenizer
from parity import check_decoder, close, sequences

VOCAB, DIM, HIDDEN, LAYERS, HEADS, KV, SEQ = 96, 64, 96, 2, 4, 2, 64


def _ref(tied: bool, vocab: int = VOCAB, layers: int = LAYERS) -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=DIM, intermediate_size=HIDDEN,
                                   num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=KV,
                                   max_position_embeddings=SEQ, rms_norm_eps=1e-5, tie_word_embeddings=tied)
    torch.manual_seed(1)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms so a misplaced norm tensor shows
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return ref


def permute_reverse(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """export.py's load_hf_model: HF rotate-half rows -> Meta interleaved pairs (llama2.c's own layout)."""
    return w.view(n_heads, 2, w.shape[0] // n_heads // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


class Meta:
    """The llama2.c Transformer's tensors (model.py names), as export.py reads them."""

    def __init__(self, ref: transformers.LlamaForCausalLM):
        sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
        self.tok = sd["model.embed_tokens.weight"]
        self.out = sd.get("lm_head.weight", self.tok)
        self.shared = torch.equal(self.tok, self.out)
        self.norm = sd["model.norm.weight"]
        p = "model.layers.{}."
        g = lambda i, n: sd[p.format(i) + n]  # noqa: E731
        self.layers = [{"attention_norm": g(i, "input_layernorm.weight"),
                        "wq": permute_reverse(g(i, "self_attn.q_proj.weight"), HEADS),
                        "wk": permute_reverse(g(i, "self_attn.k_proj.weight"), KV),  # per KV head with GQA
                        "wv": g(i, "self_attn.v_proj.weight"), "wo": g(i, "self_attn.o_proj.weight"),
                        "ffn_norm": g(i, "post_attention_layernorm.weight"), "w1": g(i, "mlp.gate_proj.weight"),
                        "w2": g(i, "mlp.down_proj.weight"), "w3": g(i, "mlp.up_proj.weight")}
                       for i in range(len(ref.model.layers))]
        self.vocab = self.tok.shape[0]
        head = DIM // HEADS
        freqs = 1.0 / (10000.0 ** (torch.arange(0, head, 2)[: head // 2].float() / head))
        angles = torch.outer(torch.arange(SEQ).float(), freqs)
        self.freqs_cos, self.freqs_sin = torch.cos(angles), torch.sin(angles)

    def each(self, key):
        return [layer[key] for layer in self.layers]


def serialize_fp32(f, t):
    f.write(t.detach().cpu().reshape(-1).numpy().astype(np.float32).tobytes())


def serialize_int8(f, t):
    f.write(t.detach().cpu().reshape(-1).numpy().astype(np.int8).tobytes())


def quantize_q80(w, group_size):
    w = w.float().reshape(-1, group_size)
    scale = torch.abs(w).max(dim=1).values / 127.0
    return torch.round(w / scale[:, None]).to(torch.int8), scale


def _params(m, vocab):
    return struct.pack("iiiiiii", DIM, HIDDEN, len(m.layers), HEADS, KV, vocab, SEQ)


def legacy_export(m, path):
    with open(path, "wb") as f:
        f.write(_params(m, m.vocab if m.shared else -m.vocab))
        serialize_fp32(f, m.tok)
        for key in ("attention_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w2", "w3"):
            for w in m.each(key):
                serialize_fp32(f, w)
        serialize_fp32(f, m.norm)
        serialize_fp32(f, m.freqs_cos[:SEQ])
        serialize_fp32(f, m.freqs_sin[:SEQ])
        if not m.shared:
            serialize_fp32(f, m.out)


def _v_header(f, m, version, group_size=None):
    f.write(struct.pack("I", 0x616B3432) + struct.pack("i", version) + _params(m, m.vocab))
    f.write(struct.pack("B", int(m.shared)))
    if group_size is not None:
        f.write(struct.pack("i", group_size))
    f.write(b"\0" * (256 - f.tell()))


def _mats(m):
    out = [m.tok] + [w for key in ("wq", "wk", "wv", "wo", "w1", "w2", "w3") for w in m.each(key)]
    return out if m.shared else out + [m.out]


def version1_export(m, path):
    with open(path, "wb") as f:
        _v_header(f, m, 1)
        for w in m.each("attention_norm") + m.each("ffn_norm") + [m.norm] + _mats(m):
            serialize_fp32(f, w)


def version2_export(m, path, group_size=64):
    while DIM % group_size:
        group_size //= 2
    with open(path, "wb") as f:
        _v_header(f, m, 2, group_size)
        for w in m.each("attention_norm") + m.each("ffn_norm") + [m.norm]:
            serialize_fp32(f, w)
        for w in _mats(m):
            q, s = quantize_q80(w, group_size)
            serialize_int8(f, q)
            serialize_fp32(f, s)
    return group_size


@pytest.mark.parametrize("tied", [True, False])
def test_v0_parity(tmp_path, tied):
    ref = _ref(tied)
    legacy_export(Meta(ref), tmp_path / "model.bin")
    m = check_decoder(ref, tmp_path / "model.bin", VOCAB)
    assert m.source.kind == "llama2c" and m.spec.name == "llama" and m.tokenizer is None
    assert ("lm_head.weight" in m.source) is not tied


def test_v1_parity(tmp_path):
    ref = _ref(False)
    version1_export(Meta(ref), tmp_path / "model_v1.bin")
    check_decoder(ref, tmp_path / "model_v1.bin", VOCAB)


def test_v2_within_int8_error(tmp_path):
    ref = _ref(True)
    gs = version2_export(Meta(ref), tmp_path / "q80.bin")
    # The reference with exactly the dequantized weights (quantized in llama2.c's layout, like export.py)
    deq = copy.deepcopy(ref)
    with torch.no_grad():
        for name, p in deq.named_parameters():
            if p.dim() == 2:
                heads = HEADS if "q_proj" in name else KV if "k_proj" in name else None
                w = permute_reverse(p, heads) if heads else p
                q, s = quantize_q80(w, gs)
                w = (q.float() * s[:, None]).view(p.shape)
                p.copy_(w.view(heads, DIM // HEADS // 2, 2, DIM).transpose(1, 2).reshape(p.shape) if heads else w)
    m = check_decoder(deq, tmp_path / "q80.bin", VOCAB)
    seqs = sequences(VOCAB)
    ours = m.logits(seqs[0])
    with torch.no_grad():
        orig = ref(torch.tensor([seqs[0]])).logits[0]
    assert (ours - orig).abs().max() < 0.05 * orig.abs().max()


def test_training_checkpoint_pt(tmp_path):
    ref = _ref(False)
    m = Meta(ref)
    sd = {"tok_embeddings.weight": m.tok, "norm.weight": m.norm, "output.weight": m.out}
    names = {"attention_norm": "attention_norm", "wq": "attention.wq", "wk": "attention.wk", "wv": "attention.wv",
             "wo": "attention.wo", "ffn_norm": "ffn_norm", "w1": "feed_forward.w1", "w2": "feed_forward.w2",
             "w3": "feed_forward.w3"}
    for i, layer in enumerate(m.layers):
        sd.update({f"layers.{i}.{names[k]}.weight": v for k, v in layer.items()})
    args = {"dim": DIM, "n_layers": LAYERS, "n_heads": HEADS, "n_kv_heads": KV, "vocab_size": VOCAB,
            "hidden_dim": None, "multiple_of": 32, "norm_eps": 1e-5, "max_seq_len": SEQ, "dropout": 0.0}
    torch.save({"model": {"_orig_mod." + k: v for k, v in sd.items()}, "model_args": args, "iter_num": 3,
                "best_val_loss": torch.tensor(2.5), "optimizer": {"state": {0: {"exp_avg": torch.zeros(4)}}},
                "config": {"batch_size": 8}}, tmp_path / "ckpt.pt")
    src = open_file(tmp_path / "ckpt.pt")
    assert isinstance(src, Llama2cSource)
    check_decoder(ref, tmp_path / "ckpt.pt", VOCAB)


def test_malformed(tmp_path):
    ref = _ref(True, layers=1)
    version1_export(Meta(ref), tmp_path / "v1.bin")
    data = (tmp_path / "v1.bin").read_bytes()
    for cut in (8, 100, 300, len(data) - 4):
        (tmp_path / "cut.bin").write_bytes(data[:cut])
        with pytest.raises(FormatError):
            open_file(tmp_path / "cut.bin")
    (tmp_path / "bad.bin").write_bytes(data[:4] + struct.pack("<i", 7) + data[8:])
    with pytest.raises(FormatError, match="version 7"):
        open_file(tmp_path / "bad.bin")
    legacy_export(Meta(ref), tmp_path / "v0.bin")
    (tmp_path / "v0cut.bin").write_bytes((tmp_path / "v0.bin").read_bytes()[:-4])  # v0 is detected by exact size
    with pytest.raises(FormatError, match="unrecognised"):
        open_file(tmp_path / "v0cut.bin")


# ---- tokenizer.bin --------------------------------------------------------------------------------------
TEXT = ("Once upon a time there was a little girl named Lily. She liked to play in the park with her dog. "
        "One day the sun was hot and the dog was happy. They ran and ran until the time to go home. ") * 20


def _sentencepiece(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT.split(". ")), model_writer=buf, vocab_size=300,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   normalization_rule_name="identity", minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=buf.getvalue())


def export_tokenizer(sp, path):
    """llama2.c tokenizer.py export()."""
    tokens, scores = [], []
    for i in range(sp.get_piece_size()):
        t = sp.id_to_piece(i)
        if i == sp.bos_id():
            t = "\n<s>\n"
        elif i == sp.eos_id():
            t = "\n</s>\n"
        tokens.append(t.replace("\u2581", " ").encode("utf-8"))
        scores.append(sp.get_score(i))
    with open(path, "wb") as f:
        f.write(struct.pack("I", max(len(t) for t in tokens)))
        for b, score in zip(tokens, scores):
            f.write(struct.pack("fI", score, len(b)))
            f.write(b)


def test_tokenizer_bin(tmp_path):
    sp = _sentencepiece(tmp_path)
    export_tokenizer(sp, tmp_path / "tokenizer.bin")
    tok = Llama2cTokenizer(tmp_path / "tokenizer.bin")
    assert tok.vocab_size == sp.get_piece_size()
    for text in ("Once upon a time", "Lily and her dog ran home.", "Zebra ümlaut ✓ x", "a"):
        ids = tok.encode(text)
        assert ids == [1] + sp.encode(text), text
        assert tok.decode(ids) == text
        assert tok.decode(ids[1:]) == " " + text  # no BOS before it: run.c keeps the dummy-prefix space
    assert tok.encode("") == [1]
    word = next(i for i in range(sp.get_piece_size()) if sp.id_to_piece(i).startswith("\u2581") and
                len(sp.id_to_piece(i)) > 2)
    assert tok.token_to_id(sp.id_to_piece(word).replace("\u2581", " ")) == word
    assert tok.decode([1, 2], skip_special_tokens=False) == "\n<s>\n\n</s>\n"


def test_tokenizer_beside_checkpoint(tmp_path):
    sp = _sentencepiece(tmp_path)
    export_tokenizer(sp, tmp_path / "tokenizer.bin")
    ref = _ref(True, vocab=sp.get_piece_size(), layers=1)
    legacy_export(Meta(ref), tmp_path / "stories.bin")
    m = inferflow.load(tmp_path / "stories.bin")
    assert isinstance(m.tokenizer, Llama2cTokenizer)
    ids = m.tokenizer.encode("Once upon a time")
    with torch.no_grad():
        close(m.logits(ids), ref(torch.tensor([ids])).logits[0], "llama2c with tokenizer")
    assert isinstance(m.generate("Once upon a time", max_new_tokens=4), str)
