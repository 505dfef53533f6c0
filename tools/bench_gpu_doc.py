"""The report of tools/bench_gpu.py: the markdown table of a run's results and the ``bench_gpu`` section of a
docs file (model, command, machine and versions, checks, the table).
"""
from __future__ import annotations

DOC_SECTION = "bench_gpu"


def write_doc(path: str, res: dict) -> None:
    """The ``bench_gpu`` section of ``path``: model, command, machine and versions, checks, the table."""
    from inferflow.bench.report import machine_line, write_section

    sh, h = res["shape"], res.get("header")
    lines = [f"### GPU fast path: inferflow vs HF transformers ({res.get('date', '')})", "",
             f"Model: hidden {sh['hidden_size']}, {sh['num_hidden_layers']} layers, {sh['num_attention_heads']} q / "
             f"{sh['num_key_value_heads']} kv heads of {sh.get('head_dim')}, intermediate {sh['intermediate_size']}, "
             f"vocab {sh['vocab_size']}, random bf16 weights shared by both systems (`tools/bench_gpu.py`). "
             f"Device: {res.get('device')}, torch {res.get('torch')}, transformers {res.get('transformers')}.", ""]
    if h:
        lines += [machine_line(h), "", "```bash", h["command"], "```", ""]
    lg = res.get("logits")
    if lg:
        lines += [f"Checks: last-position logits vs HF, max |diff| / max |ref| {lg['max_rel_diff']:.4f}, top-1 "
                  f"{lg['top1_agree']}/{lg['of']}; kernels vs torch (max |diff|): "
                  + (", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                               for k, v in res["kernel_max_abs_err"].items()) or "not run (no Triton device)"
                     if isinstance(res.get("kernel_max_abs_err"), dict) else str(res.get("kernel_max_abs_err"))), ""]
    errors = sorted(k for k in res if k.endswith("_error"))
    if errors:
        lines += [f"Phases that failed (see bench_gpu.json): {', '.join(errors)}.", ""]
    lines.append(table(res, [int(b) for b in str(res["args"]["batches"]).split(",")]))
    write_section(path, "\n".join(lines), DOC_SECTION)


def table(res: dict, batches: list[int]) -> str:
    hf = "HF StaticCache + torch.compile" if res.get("hf_compiled", True) else "HF StaticCache (NOT compiled)"
    rows = [f"| measurement | inferflow | {hf} (prefill: see the row) | ratio |", "|---|---:|---:|---:|"]
    d = res.get("decode", {})
    for b in batches:
        if f"inferflow b{b}" in d and f"hf b{b}" in d:
            o, h = d[f"inferflow b{b}"]["tps"], d[f"hf b{b}"]["tps"]
            rows.append(f"| decode tok/s, batch {b} | {o:.1f} | {h:.1f} | {o / h:.2f} |")
    if "prefill" in res:
        pf, n = res["prefill"], res["args"].get("prefill_len", 2048)
        o = pf["inferflow"]["tps"]
        if "hf_static" in pf:  # the comparator: HF's static-cache path runs the prompt eagerly into its cache
            h = pf["hf_static"]["tps"]
            rows.append(f"| prefill tok/s, {n}-token prompts, vs HF's static-cache path (StaticCache, eager prompt "
                        f"forward) | {o:.0f} | {h:.0f} | {o / h:.2f} |")
        h = pf["hf"]["tps"]
        rows.append(f"| prefill tok/s, {n}-token prompts, vs HF eager without a cache (HF's fastest) | {o:.0f} | "
                    f"{h:.0f} | {o / h:.2f} |")
    if "serving" in res:
        sv = res["serving"]
        rows.append(f"| serving ({sv['requests']} req x 512+256 tok, all queued, {res['args']['batches'].split(',')[-1]} "
                    f"concurrent): output tok/s | {sv['output_tok_s']:.0f} | | |")
        rows.append(f"| serving TTFT median / p99 ms | {sv['ttft_ms_median']:.0f} / {sv['ttft_ms_p99']:.0f} | | |")
    q4 = res.get("q4_decode", {})
    for b in batches:
        if f"q4 b{b}" in q4:
            v, base = q4[f"q4 b{b}"]["tps"], q4[f"bf16 b{b}"]["tps"]
            rows.append(f"| q4 decode tok/s, batch {b} (bf16 in the same phase: {base:.1f}) | {v:.1f} | | "
                        f"{v / base:.2f} x bf16 |")
        if f"q4 triton b{b}" in q4:  # --q4-ab: the same q4 model with Triton's kernels only, interleaved
            t = q4[f"q4 triton b{b}"]["tps"]
            rows.append(f"| q4 decode tok/s, batch {b}, Triton kernels only (`--q4-ab`) | {t:.1f} | | "
                        f"{t / base:.2f} x bf16 |")
    return "\n".join(rows)
