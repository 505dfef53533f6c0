"""The README's Serving examples (curl and the openai package) run as written against a live server.

The server is the service built from a config naming its model SmolLM2-135M-Instruct, like the default one, but
backed by a tiny random model so the examples run in seconds; only the port differs from the README's 8080."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from service_helpers import LiveServer, chat_llama

README = Path(__file__).resolve().parent.parent / "README.md"


def _serving_blocks() -> dict[str, list[str]]:
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Serving\n", 1)[1].split("\n## ", 1)[0]
    blocks: dict[str, list[str]] = {}
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", section, re.S):
        blocks.setdefault(lang, []).append(body)
    return blocks


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from inferflow.service import config_from_dict, create_app

    folder = chat_llama(tmp_path_factory.mktemp("readme") / "m")
    app = create_app(config_from_dict({"models": [{"name": "SmolLM2-135M-Instruct", "source": str(folder)}]}))
    with LiveServer(app) as srv:
        yield srv


def _local(code: str, srv) -> str:
    assert "127.0.0.1:8080" in code
    return code.replace("127.0.0.1:8080", f"127.0.0.1:{srv.port}")


def test_readme_curl_examples(server):
    curls = [b for b in _serving_blocks()["bash"] if "curl " in b]
    assert len(curls) == 1
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", _local(curls[0], server)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert '"object":"chat.completion"' in out.stdout and "data: [DONE]" in out.stdout
    assert '"ret_code":"succ"' in out.stdout and '"error"' not in out.stdout


def test_readme_openai_example(server):
    code = [b for b in _serving_blocks()["python"] if "from openai import" in b]
    assert len(code) == 1
    out = subprocess.run([sys.executable, "-c", _local(code[0], server)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "CompletionUsage(" in out.stdout
