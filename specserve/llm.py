"""The offline API: `LLM(model=...).generate(prompts, SamplingParams)` and `.chat(messages)`."""
from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from specserve.config import engine_config_from_args
from specserve.engine.engine import LLMEngine, PromptType
from specserve.engine.intake import Prompt
from specserve.engine.outputs import RequestOutput
from specserve.sampling_params import SamplingParams


class LLM:
    """Engine arguments are the CLI long flag names with underscores (dtype, max_model_len,
    num_kv_blocks, enable_prefix_caching, speculative_config, ...). `model=None` = the default model."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(engine_config_from_args(model=model, **engine_args))
        self._counter = 0

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); they also stop when this process exits."""
        self.engine.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run all prompts to completion with continuous batching; outputs in prompt order."""
        if isinstance(prompts, (str, dict, Prompt)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        for prompt, p in zip(prompts, params):
            self._counter += 1
            ids.append(self.engine.add_request(f"offline-{self._counter}", prompt,
                                               p or self.get_default_sampling_params()))
        return self._run(ids, use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses without sampling params: the model's generation config defaults
        (`generation_config`, as vLLM), else SamplingParams()."""
        return SamplingParams(**self.engine.sampling_defaults)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, tools: list[dict] | None = None) -> list[RequestOutput]:
        """One conversation (a list of {role, content}, OpenAI's message shape: assistant `tool_calls`
        and `tool` results too) or several; the chat template is applied, with `tools` (OpenAI's
        function tools) when given. Tool calls stay text here: the server parses them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.engine.intake.chat(c, tools) for c in conversations], sampling_params,
                             use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        done: dict[str, RequestOutput] = {}
        failed: dict[str, str] = {}  # the engine ended these: steps with them raised
        bar = tqdm(total=len(ids), desc="Generating", disable=not (use_tqdm and sys.stderr.isatty()))
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step(finished_only=True):
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
                failed.update(self.engine.take_failures())
                failed.update(self.engine.take_rejections())  # a grammar that did not compile
        except BaseException:
            for req_id in ids:
                self.engine.abort(req_id)
            raise
        finally:
            bar.close()
        if failed:
            req_id, why = next(iter(failed.items()))
            others = "the others completed" if len(failed) < len(ids) else "all of them"
            raise RuntimeError(f"{len(failed)} of {len(ids)} requests failed ({others}); request {req_id}: {why}")
        return [done[i] for i in ids]
