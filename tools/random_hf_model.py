"""Write a random-initialised HF Llama folder of a real model's shape (for GPU benchmarks where the real weights
cannot travel): throughput does not depend on the weight values when EOS is ignored.

    python tools/random_hf_model.py smollm2-135m /tmp/smollm2-135m   # or llama-1b
"""
import sys, torch, transformers
shape, out = sys.argv[1], sys.argv[2]
cfgs = {
 "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=100000.0),
 "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=500000.0),
}
torch.manual_seed(0)
cfg = transformers.LlamaConfig(**cfgs[shape], torch_dtype="bfloat16")
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    m = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
m.save_pretrained(out)
print("saved", out)
