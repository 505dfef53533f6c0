"""``inferflow chat``: an interactive terminal chat with streaming replies and multi-turn history.

Commands: ``/exit`` or ``/quit`` (also Ctrl-D), ``/reset`` (forget the conversation), ``/system TEXT`` (set the
system prompt; empty TEXT removes it), ``/think on|off`` (templates with an ``enable_thinking`` switch),
``/stats`` (the last reply's speed and the conversation's size). Ctrl-C stops a reply and cancels its request.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any, TextIO

from ..engine.sampling_params import SamplingParams
from ..errors import InferflowError

HELP = "Commands: /exit, /quit, /reset, /system TEXT, /think on|off, /stats"


class ChatSession:
    def __init__(self, served: Any, params: SamplingParams, system: str | None = None,
                 out: TextIO | None = None):
        self.served, self.params, self.system, self.out = served, params, system, out or sys.stdout
        self.history: list[dict[str, str]] = []
        self.think: bool | None = None
        self.last: dict[str, Any] = {}
        self.last_prompt = ""

    def messages(self) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.history

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def command(self, line: str) -> bool:
        """Handle a /command; False when the session should end."""
        cmd, _, arg = line.partition(" ")
        arg = arg.strip()
        if cmd in ("/exit", "/quit"):
            return False
        if cmd == "/reset":
            self.history.clear()
            self.last = {}
            self.say("[conversation reset]")
        elif cmd == "/system":
            self.system = arg or None
            self.say(f"[system prompt {'set' if arg else 'removed'}]")
        elif cmd == "/think":
            if arg not in ("on", "off"):
                self.say("usage: /think on|off")
            elif "enable_thinking" not in self.served.chat_template():
                self.say("[this model's chat template has no thinking switch]")
            else:
                self.think = arg == "on"
                self.say(f"[thinking {arg}]")
        elif cmd == "/stats":
            self.stats()
        else:
            self.say(f"unknown command {cmd}. {HELP}")
        return True

    def stats(self) -> None:
        turns = sum(m["role"] == "user" for m in self.history)
        if self.last:
            s = self.last
            self.say(f"[last reply: {s['tokens']} tokens in {s['seconds']:.2f}s ({s['tps']:.1f} tokens/s), first "
                     f"token after {s['ttft']:.2f}s; prompt {s['prompt']} tokens ({s['cached']} from the prefix "
                     f"cache)]")
        m = self.served.engine.metrics()
        self.say(f"[conversation: {turns} turns; context limit {self.served.max_model_len} tokens; KV blocks "
                 f"used {m.get('kv_blocks_used')}, cached {m.get('kv_blocks_cached')}]")

    def reply(self, text: str) -> None:
        self.history.append({"role": "user", "content": text})
        kwargs = {} if self.think is None else {"enable_thinking": self.think}
        try:
            prompt = self.served.render_chat(self.messages(), template_kwargs=kwargs)
        except Exception as e:  # an APIError from the template: tell the user, keep the session
            self.history.pop()
            self.say(f"[cannot render the conversation: {getattr(e, 'message', e)}]")
            return
        self.last_prompt = prompt
        ids = self.served.encode(prompt, add_special_tokens=False)
        if len(ids) >= self.served.max_model_len:
            self.history.pop()
            self.say(f"[the conversation has {len(ids)} tokens; the model's context is {self.served.max_model_len}: "
                     f"/reset to start over]")
            return
        params = dataclasses.replace(self.params, max_tokens=self.served.fit_max_tokens(
            len(ids), self.params.max_tokens, "messages", clip=True))
        t0 = time.perf_counter()
        ttft, final = None, None
        handle = self.served.engine.add_request(ids, params)
        try:
            for delta in handle:
                o = delta.outputs[0]
                if ttft is None and o.token_ids:
                    ttft = time.perf_counter() - t0
                self.out.write(o.delta_text)
                self.out.flush()
                final = delta
        except KeyboardInterrupt:
            handle.cancel()
            self.say("\n[interrupted]")
            self.history.pop()
            return
        self.out.write("\n")
        o = final.outputs[0]
        if final.error:
            self.say(f"[error: {final.error}]")
        self.history.append({"role": "assistant", "content": o.text})
        seconds = time.perf_counter() - t0
        self.last = {"tokens": len(o.token_ids), "seconds": seconds, "ttft": ttft or seconds,
                     "tps": len(o.token_ids) / seconds if seconds else 0.0, "prompt": len(ids),
                     "cached": final.num_cached_tokens}


def chat_loop(session: ChatSession, read: Any = input) -> int:
    session.say(f"inferflow chat with {session.served.name}. {HELP}")
    while True:
        try:
            line = read("> ")
        except EOFError:
            session.say("")
            return 0
        except KeyboardInterrupt:
            session.say("")
            continue
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            if not session.command(line):
                return 0
            continue
        session.reply(line)


def chat_main(argv: list[str] | None = None) -> int:
    """Interactive chat with a model (default: the embedded default model)."""
    ap = argparse.ArgumentParser(prog="inferflow chat", description=chat_main.__doc__)
    ap.add_argument("--model", help="model folder or file (default: the embedded default model)")
    ap.add_argument("--spec", help="spec name or file (default: detected)")
    ap.add_argument("--dtype")
    ap.add_argument("--device")
    ap.add_argument("--system", help="system prompt")
    ap.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=512,
                    help="longest reply (default 512; --max-new-tokens as in generate and llm_inference)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--seed", type=int)
    args = ap.parse_args(argv)
    try:
        from ..engine.config import EngineConfig
        from .config import ModelConfig
        from .progress import LoadBar
        from .served_model import ServedModel, load_model

        cfg = ModelConfig(name=args.model or "SmolLM2-135M-Instruct", source=args.model, spec=args.spec,
                          dtype=args.dtype, device=args.device, engine=EngineConfig(max_num_seqs=4, kv_cache_memory=0.25))  # one user
        with LoadBar("Loading model") as bar:
            model = load_model(cfg, progress=bar)
        served = ServedModel(cfg, model)
        if not served.generates:
            raise InferflowError(f"{cfg.name} is an encoder-only model; it cannot chat")
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
        return chat_loop(ChatSession(served, params, args.system))
    except InferflowError as e:
        print(f"inferflow chat: {e}", file=sys.stderr)
        return 2
