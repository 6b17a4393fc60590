"""Structured outputs: the grammar engine (xgrammar) behind `SamplingParams.structured_outputs`.

Why xgrammar: one library compiles every constraint we take (a JSON schema, any JSON object, a
regular expression, a choice of strings, an EBNF grammar) against the model's tokenizer into a
per-token automaton with precomputed masks; its `GrammarMatcher` fills one 32-bit-packed bitmask row
per sample in microseconds, supports rollback (what draft verification needs), and applies masks in
place with a CPU kernel (in its compiled bindings) or a Triton kernel on GPUs (no CUDA build at run
time). vLLM and SGLang use it as their default backend.

The parts, in the order a request meets them:
- `check_constraint` (front end, no tokenizer needed; in grammars.py, torch-free): parses the
  schema / regex / grammar into an xgrammar `Grammar`, so a bad one is refused with a message
  naming the problem before the request reaches the engine. Parsing is cheap (~0.3 ms for a small
  schema); the tokenizer-dependent part (the token masks) is what compiling adds, and that runs
  once, in the engine.
- `GrammarCompiler` (engine): the tokenizer info is built once per engine (from the HF tokenizer,
  the model's vocabulary size, which may exceed the tokenizer's, and the engine's eos ids);
  `submit` compiles in a worker thread, off the step loop, and keeps compiled grammars in an LRU
  keyed by the constraint.
- `RequestGrammar` (one per sample): the matcher; the scheduler advances it with every output token
  it appends; a terminated grammar ends the request.
- `GrammarMasks`: fills the masks of the constrained rows of one sampling call and applies them to
  the logits on their device (only those rows; other rows are untouched).
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from specserve.sample.grammars import MAX_CACHED_GRAMMARS, Constraint, _clean, _parse, constraint_key
from specserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

class GrammarCompiler:
    """Compiles constraints against one engine's tokenizer, in a worker thread, with an LRU cache.

    `submit` (on the engine's thread) returns a Future of the compiled grammar; concurrent requests
    with the same constraint share one compilation. The tokenizer info is built by the worker on
    the first submit, so an engine that never sees a constraint pays nothing (xgrammar is not even
    imported)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int] = (),
                 max_cached: int = MAX_CACHED_GRAMMARS) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.max_cached = max_cached
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-grammar")
        self._compiler = None  # xgrammar.GrammarCompiler, made by the worker
        self._cache: OrderedDict[Constraint, Future] = OrderedDict()

    def submit(self, c: StructuredOutputsParams) -> Future:
        """A Future of the compiled grammar (xgrammar.CompiledGrammar); its exception is a ValueError
        saying why the constraint cannot be compiled."""
        key = constraint_key(c)
        future = self._cache.get(key)
        if future is not None:  # compiled, compiling, or failed (it would fail again the same way)
            self._cache.move_to_end(key)
            return future
        future = self._pool.submit(self._compile, key)
        self._cache[key] = future
        while len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)
        return future

    def compile(self, c: StructuredOutputsParams):
        """Compile now (waiting for the worker): for callers off the step loop."""
        return self.submit(c).result()

    def matcher(self, compiled) -> RequestGrammar:
        return RequestGrammar(compiled)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, key: Constraint):
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids or None)
            # xgrammar's own cache is unbounded; ours (the futures) is the LRU
            self._compiler = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1),
                                                 cache_enabled=False)
        try:
            return self._compiler.compile_grammar(_parse(key))
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"structured_outputs: {_clean(e)}") from None


class RequestGrammar:
    """One sample's grammar state. `accept` is called with every output token the request keeps (by
    the scheduler, in order); the masks for the next token (and, when verifying drafts, for each
    draft position) come from `fill` / `fill_drafts`."""

    __slots__ = ("matcher", "num_accepted", "ended")

    def __init__(self, compiled) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0
        self.ended = False  # terminated (a stop token was accepted), or a token it refused came

    def accept(self, token_id: int) -> bool:
        """Advance by one output token; True once the grammar has ended (the request must stop)."""
        if self.ended:
            return True
        if not self.matcher.accept_token(token_id):
            # masked sampling never picks a refused token; if one comes anyway, end here
            logger.warning("the grammar refused output token %d; the request ends", token_id)
            self.ended = True
            return True
        self.num_accepted += 1
        self.ended = self.matcher.is_terminated()
        return self.ended

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 bits, on the host)."""
        if self.ended:
            bitmask[row] = -1  # the request ends at its last token: nothing left to constrain
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_drafts(self, draft_ids: Sequence[int], bitmask: torch.Tensor, first_row: int) -> int:
        """Masks for the 1 + k positions of a verification (rows first_row .. first_row + k): row j
        holds the tokens allowed after the drafts d_1..d_j, found by advancing the matcher
        tentatively and rolling it back afterwards. Returns how many leading drafts the grammar
        accepts: a draft it refuses ends the acceptable prefix (rows after it allow everything; the
        accepted prefix never reaches them)."""
        self.fill(bitmask, first_row)
        if self.ended:
            return 0
        walked = 0
        for j, token_id in enumerate(draft_ids):
            if not self.matcher.accept_token(token_id):
                bitmask[first_row + j + 1:first_row + 1 + len(draft_ids)] = -1
                break
            walked += 1
            if self.matcher.is_terminated():  # a stop token: the request ends with this draft
                bitmask[first_row + j + 1:first_row + 1 + len(draft_ids)] = -1
                break
            self.matcher.fill_next_token_bitmask(bitmask, first_row + j + 1)
        if walked:
            self.matcher.rollback(walked)
        return walked


class GrammarMasks:
    """Host bitmask rows for one sampling call, applied to the logits on their device with
    xgrammar's in-place kernel (its C++ CPU kernel, or its Triton kernel on CUDA)."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None  # [rows, ceil(V / 32)] int32

    def buffer(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        """A host bitmask of at least [num_rows, ceil(vocab_size / 32)], all bits set (no mask)."""
        width = (vocab_size + 31) // 32
        host = self._host
        if host is None or host.shape[0] < num_rows or host.shape[1] != width:
            host = self._host = torch.empty(max(num_rows, 8), width, dtype=torch.int32)
        host[:num_rows] = -1
        return host[:num_rows]

    @staticmethod
    def warm_up(device: torch.device, vocab_size: int) -> None:
        """Apply one mask on `device`: on CUDA, xgrammar's Triton kernel compiles on its first call."""
        logits = torch.zeros(1, vocab_size, device=device)
        GrammarMasks.apply(logits, torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32), [0])

    @staticmethod
    def apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """logits[r] = -inf where bitmask[r] has a 0 bit, for r in `rows`. logits: [N, V] fp32 on
        its device; bitmask: [N, ceil(V / 32)] int32 on the host (copied over here)."""
        import xgrammar as xgr

        if not rows:
            return
        device = logits.device
        backend = {"cpu": "cpu", "cuda": "triton"}.get(device.type, "torch_native")
        # a blocking copy from pageable memory: the host buffer may be refilled right after
        mask = bitmask if device.type == "cpu" else bitmask.to(device)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[1], indices=list(rows),
                                        backend=backend)
