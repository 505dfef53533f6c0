"""Per-request decoding settings: the union of OpenAI, vLLM and Inferflow's decoding strategies."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import InferflowError


@dataclass(slots=True)
class SamplingParams:
    """What one request asks of the sampler and the stop logic.

    ``temperature == 0`` (or ``top_k == 1``) is greedy. Sampler order (llama.cpp / vLLM): logit processors
    (logit_bias, penalties, FSD n-gram penalty, min_tokens / EOS bypass masking) -> temperature -> top_k ->
    top_p -> min_p -> typical_p -> tfs_z -> sample; mirostat (v2) replaces the truncation samplers.
    """

    n: int = 1                              # parallel samples sharing the prompt's KV blocks
    max_tokens: int | None = 16             # None: up to the context length
    min_tokens: int = 0                     # EOS / stop ids masked until this many tokens were produced
    temperature: float = 1.0
    top_k: int = 0                          # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    tfs_z: float = 1.0                      # tail-free sampling; 1.0: off
    mirostat: int = 0                       # 0 off, 2 = mirostat v2
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    fsd_alpha: float = 0.0                  # Frustratingly Simple Decoding: 0 off; Inferflow default 0.5
    fsd_k: int = 6
    fsd_n: int = 3
    fsd_beta: float = 0.9
    repetition_penalty: float = 1.0         # HF: over prompt + output tokens
    presence_penalty: float = 0.0           # OpenAI: over output tokens
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    seed: int | None = None                 # same seed, same tokens, whatever else is in the batch
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    eos_bypass_max: int = 0                 # Inferflow: replace a sampled EOS by the best other token, N times
    logprobs: int | None = None             # top-N alternatives per output token (0: just the chosen one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = False
    # guided decoding (engine/guided/): the output must be a JSON object (True / {}), match a JSON schema (a
    # dict, or its JSON text) or be one of ``guided_choice``; prefix / suffix: fixed text around it (tool calls)
    guided_json: dict | str | bool | None = None
    guided_choice: list[str] | None = None
    guided_prefix: str = ""
    guided_suffix: str = ""

    def __post_init__(self) -> None:
        def bad(key: str, want: str) -> InferflowError:
            return InferflowError(f"sampling: {key} = {getattr(self, key)!r}; expected {want}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "an integer >= 1 or null")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", "0 <= min_tokens <= max_tokens")
        if self.temperature < 0:
            raise bad("temperature", "a number >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "a number in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "a number in [0, 1]")
        if not 0.0 < self.typical_p <= 1.0:
            raise bad("typical_p", "a number in (0, 1]")
        if not 0.0 < self.tfs_z <= 1.0:
            raise bad("tfs_z", "a number in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "-1, 0 (off) or a positive integer")
        if self.mirostat not in (0, 2):
            raise bad("mirostat", "0 (off) or 2 (mirostat v2)")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "a number > 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "a number in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "a number in [-2, 2]")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", "an integer >= 0 or null")
        if self.use_beam_search and self.beam_width < 1:
            raise bad("beam_width", "an integer >= 1")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

    @property
    def greedy(self) -> bool:
        return (self.temperature == 0.0 or self.top_k == 1) and self.mirostat == 0 and self.fsd_alpha == 0.0
