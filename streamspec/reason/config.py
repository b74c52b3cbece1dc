"""SpecReason settings: `ReasonConfig` (the algorithm) and `BackendConfig` (where a model runs).

Both are validated dataclasses; a YAML file with sections ``reason``, ``base``, ``drafter`` and
``judge`` (the judge defaults to the base) builds them, with ``section.key=value`` overrides as
for training recipes (`load_reason_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

SCORES = ("argmax", "expected", "p_no_error", "p_correct", "log_odds")  # every request's readings
ANSWER_FORMATS = ("boxed", "gsm8k", "number")


@dataclass
class ReasonConfig:
    """How SpecReason decides each step (METHOD §2), with the defaults of the public code.

    Args:
        judge_request: what the judge is asked (`streamspec.reason.judging.JUDGE_REQUESTS`):
            ``"error_yes_no_fewshot"`` (the default: "does the last step contain an error?"
            after three worked verdicts, the request that separated best on CHAMP),
            ``"score_0_9"`` (the paper's 0-9 score), ``"error_yes_no"``, ``"correct_yes_no"``
            or ``"correct_or_error"`` (the YAML key ``judge.request`` sets it too).
        threshold: keep a drafted step when the judge's score is >= this, in the score's own
            units (0..9 for score_0_9; a probability for the yes/no requests' first reading);
            default the request's (0.4 for error_yes_no_fewshot, fitted on CHAMP; 7 for
            score_0_9; 0.5 for the other yes/no requests).
        score: how the answer is read, one of the request's readings (default its first): for
            score_0_9 ``"argmax"`` (the judge's most likely next token; a non-digit counts as
            0) or ``"expected"`` (Σ d·p(d) over the digit tokens' probabilities, renormalised);
            for error_yes_no(_fewshot) ``"p_no_error"`` or ``"log_odds"``; for correct_yes_no
            and correct_or_error ``"p_correct"`` or ``"log_odds"``.
        step_delimiter: a step is the text up to and including this.
        step_max_tokens: the most tokens one step may take.
        token_budget: every generated token counts (kept and rejected drafts, rewrites, the
            answer phase); no call is allowed to overshoot it. `answer_max_tokens` of it are
            kept back for the answer phase.
        first_base_steps: the base writes this many first steps itself, unjudged.
        temperature, top_p: sampling of every step (drafts, rewrites); temperature 0 is greedy.
        seed: seeds every sampler (reproducible runs); None draws a fresh seed.
        answer_max_tokens: tokens of the explicit answer phase that runs when the reasoning stops
            without an answer (budget, repetition, the model ending its turn).
        answer_format: how the answer is read from the text: ``"boxed"`` (the last complete
            ``\\boxed{}``), ``"gsm8k"`` (boxed, else a final ``#### N``), ``"number"`` (the last number).
    """

    threshold: float | None = None
    score: str | None = None
    judge_request: str = "error_yes_no_fewshot"
    step_delimiter: str = "\n\n"
    step_max_tokens: int = 512
    token_budget: int = 8192
    first_base_steps: int = 0
    temperature: float = 0.6
    top_p: float = 0.95
    seed: int | None = None
    answer_max_tokens: int = 32
    answer_format: str = "boxed"

    def __post_init__(self) -> None:
        from .judging import JUDGE_REQUESTS

        if self.judge_request not in JUDGE_REQUESTS:
            raise ValueError(f"ReasonConfig.judge_request must be one of {list(JUDGE_REQUESTS)}, got {self.judge_request!r}")
        request = JUDGE_REQUESTS[self.judge_request]
        if self.score is None:
            self.score = request.scores[0]
        if self.score not in request.scores:
            raise ValueError(f"ReasonConfig.score must be one of {list(request.scores)} for the judge request "
                             f"{self.judge_request!r}, got {self.score!r}")
        if self.threshold is None:
            self.threshold = request.default_threshold
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)):
            raise ValueError(f"ReasonConfig.threshold must be a number, got {self.threshold!r}")
        try:
            request.check_threshold(float(self.threshold), self.score)
        except ValueError as err:
            raise ValueError(f"ReasonConfig.threshold: {err}") from None
        self.threshold = float(self.threshold)
        if not isinstance(self.step_delimiter, str) or not self.step_delimiter:
            raise ValueError(f"ReasonConfig.step_delimiter must be a non-empty string, got {self.step_delimiter!r}")
        for name in ("step_max_tokens", "token_budget", "answer_max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ReasonConfig.{name} must be an integer >= 1, got {value!r}")
        if self.token_budget <= self.answer_max_tokens:
            raise ValueError(
                f"ReasonConfig.token_budget ({self.token_budget}) must exceed answer_max_tokens ({self.answer_max_tokens}), "
                "which it keeps back for the answer phase"
            )
        if isinstance(self.first_base_steps, bool) or not isinstance(self.first_base_steps, int) or self.first_base_steps < 0:
            raise ValueError(f"ReasonConfig.first_base_steps must be an integer >= 0, got {self.first_base_steps!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"ReasonConfig.temperature must be a number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"ReasonConfig.top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"ReasonConfig.seed must be an integer or null, got {self.seed!r}")
        if self.answer_format not in ANSWER_FORMATS:
            raise ValueError(f"ReasonConfig.answer_format must be one of {list(ANSWER_FORMATS)}, got {self.answer_format!r}")

    @property
    def reasoning_budget(self) -> int:
        """Tokens the steps may take: the budget less what the answer phase keeps back."""
        return self.token_budget - self.answer_max_tokens


@dataclass
class BackendConfig:
    """Where one role (base, drafter or judge) runs.

    Args:
        source: a streamed checkpoint folder, a model folder, a hub id, the default model id
            (``streamspec:SmolLM2-135M-Instruct``), a folder holding `gguf_file`, or the URL of
            an OpenAI-compatible server (``http://host:port/v1``), or ``llama.cpp:GGUF``: a GGUF
            (a path, ``streamspec:SmolLM2-135M-Instruct`` or a reasoning model's id such as
            ``streamspec:Qwen2.5-Coder-1.5B-Instruct``) on llama.cpp started in this process
            (`streamspec.reason.backends.LlamaCppBackend`).
        model: the served model name (servers only; required there: no model listing per call).
        gguf_file: a GGUF file name inside the `source` folder.
        tokenizer: where the chat template comes from for a server (default: `model`); in
            process the model's own tokenizer is used.
        device, dtype: in process only (``auto``: CUDA and bf16 when a GPU is present, else the
            CPU in fp32).
        streams: decode a streamed checkpoint with speculative streaming; False runs its base
            without streams (the baseline that shows what the streams add).
        tree_top_k: the draft tree of a streamed model (an int, or one int per depth; default:
            (2, 1, 1) on a CPU, 3 per depth on an accelerator).
        prune_threshold, lookup (``"L,M[,N]"``), tree_budget, verify, compile: the other decode
            options of a streamed model, as `streamspec.decoding.DecodeConfig` takes them
            (`decode_config`).
        timeout: seconds per server request; retries: further tries after a failed one.
        api_key: sent as a bearer token to a server (default: $OPENAI_API_KEY, else none).
        threads: llama.cpp's CPU threads for a ``llama.cpp:`` source.
    """

    source: str
    model: str | None = None
    gguf_file: str | None = None
    tokenizer: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    streams: bool = True
    tree_top_k: int | list[int] | None = None
    prune_threshold: float | None = None
    lookup: str | None = None
    tree_budget: int | None = None
    verify: str = "auto"
    compile: bool | str = False
    timeout: float = 300.0
    retries: int = 2
    api_key: str | None = None
    threads: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"BackendConfig.source must be a model path, id or server URL, got {self.source!r}")
        if self.llama_cpp is not None and not self.llama_cpp:
            raise ValueError("BackendConfig.source llama.cpp: needs a GGUF after the colon (a path or a built-in name)")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"BackendConfig.threads must be an integer >= 1, got {self.threads!r}")
        if self.is_server and not self.model:
            raise ValueError(f"BackendConfig.model must name the served model for the server {self.source}")
        if not isinstance(self.timeout, (int, float)) or self.timeout <= 0:
            raise ValueError(f"BackendConfig.timeout must be > 0 seconds, got {self.timeout!r}")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"BackendConfig.retries must be an integer >= 0, got {self.retries!r}")
        self.decode_config()  # a bad decode option fails here, naming it

    def decode_config(self):
        """The `streamspec.decoding.DecodeConfig` of this backend's decode options."""
        from ..decoding.config import DecodeConfig
        from ..decoding.lookup import PromptLookup

        top_k = tuple(self.tree_top_k) if isinstance(self.tree_top_k, list) else self.tree_top_k
        lookup = PromptLookup.parse(self.lookup) if isinstance(self.lookup, str) else self.lookup
        return DecodeConfig(tree_top_k=top_k, prune_threshold=self.prune_threshold, lookup=lookup,
                            tree_budget=self.tree_budget, verify=self.verify, compile=self.compile)

    @property
    def llama_cpp(self) -> str | None:
        """The GGUF of a ``llama.cpp:GGUF`` source, else None."""
        from ..llamacpp import parse_llama_cpp

        return parse_llama_cpp(self.source)

    @property
    def is_server(self) -> bool:
        return self.source.startswith(("http://", "https://"))


_SECTIONS = {"reason": ReasonConfig, "base": BackendConfig, "drafter": BackendConfig, "judge": BackendConfig}


@dataclass
class ReasonSetup:
    """A whole SpecReason setup as read from YAML."""

    reason: ReasonConfig = field(default_factory=ReasonConfig)
    base: BackendConfig | None = None
    drafter: BackendConfig | None = None
    judge: BackendConfig | None = None


def load_reason_config(path: str | Path | None = None, overrides: list[str] | None = None) -> ReasonSetup:
    """Read a YAML file (sections ``reason``, ``base``, ``drafter``, ``judge``) and apply
    ``section.key=value`` overrides (values parsed as YAML)."""
    from ..config import build_section

    raw: dict[str, Any] = {}
    if path is not None:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: must be a mapping of sections {sorted(_SECTIONS)}")
    for item in overrides or []:
        key, sep, value = item.partition("=")
        section, _, name = key.partition(".")
        if not sep or not name:
            raise ValueError(f"override {item!r} must look like section.key=value (e.g. reason.threshold=9)")
        if section not in _SECTIONS:
            raise ValueError(f"override {item!r}: unknown section {section!r}; allowed: {sorted(_SECTIONS)}")
        raw.setdefault(section, {})
        raw[section][name] = yaml.safe_load(value)
    judge = raw.get("judge")
    if isinstance(judge, dict) and "request" in judge:  # judge.request: how the judge is asked (a reason setting)
        raw.setdefault("reason", {})["judge_request"] = judge.pop("request")
        if not judge:
            del raw["judge"]
    unknown = sorted(set(raw) - set(_SECTIONS))
    if unknown:
        raise ValueError(f"{path or 'reason config'}: unknown section(s) {unknown}; allowed: {sorted(_SECTIONS)}")
    built = {}
    for name, cls in _SECTIONS.items():
        values = raw.get(name)
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ValueError(f"{path or 'reason config'}: section {name!r} must be a mapping")
        built[name] = build_section(cls, values, name, str(path or "reason config"))
    return ReasonSetup(**built)
