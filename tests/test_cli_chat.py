"""``inferflow chat`` through a pseudo-terminal: streaming replies, /stats, /system, /think, /reset, /exit."""
import io
import sys
from pathlib import Path

import pexpect

from service_helpers import chat_llama

ROOT = Path(__file__).resolve().parent.parent


def test_chat_in_a_terminal(tmp_path):
    folder = chat_llama(tmp_path / "tiny")
    child = pexpect.spawn(sys.executable, ["-m", "inferflow.cli", "chat", "--model", str(folder), "--max-new-tokens", "5",
                                           "--temperature", "0"], cwd=str(ROOT), encoding="utf-8", timeout=60,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    try:
        child.expect("Commands: /exit, /quit, /reset, /system TEXT, /think on\\|off, /stats")
        child.expect("> ")
        child.sendline("hello there")
        child.expect("> ")
        child.sendline("/stats")
        child.expect(r"\[last reply: \d+ tokens")
        child.expect(r"conversation: 1 turns")
        child.sendline("the quick brown fox")
        child.expect("> ")
        child.sendline("/stats")
        child.expect(r"conversation: 2 turns")
        child.sendline("/system be brief")
        child.expect(r"\[system prompt set\]")
        child.sendline("/think on")
        child.expect(r"no thinking switch")
        child.sendline("/reset")
        child.expect(r"\[conversation reset\]")
        child.sendline("/stats")
        child.expect(r"conversation: 0 turns")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before


THINK = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not "
         "enable_thinking %}<think></think>{% endif %}{% endif %}")


def test_session_system_and_think_switch(tmp_path):
    from inferflow.engine.sampling_params import SamplingParams
    from inferflow.service.chat_cli import ChatSession
    from inferflow.service.config import ModelConfig
    from inferflow.service.served_model import ServedModel

    folder = chat_llama(tmp_path / "tiny")
    served = ServedModel.load(ModelConfig(name="t", source=str(folder), chat_template=THINK))
    out = io.StringIO()
    chat = ChatSession(served, SamplingParams(max_tokens=3, temperature=0), out=out)
    assert chat.command("/system be brief") and chat.command("/think off")
    chat.reply("hello")
    assert chat.last_prompt.startswith("<|im_start|>system\nbe brief<|im_end|>")
    assert chat.last_prompt.endswith("<|im_start|>assistant\n<think></think>")
    assert "[thinking off]" in out.getvalue() and len(chat.history) == 2
    chat.command("/think on")
    chat.reply("again")
    assert not chat.last_prompt.endswith("<think></think>") and len(chat.history) == 4
    assert not chat.command("/quit")
    served.engine.scheduler.pool.assert_clean()
