"""The only part that touches tensors: turns a SchedulerOutput into one forward over a flat ragged
batch, samples, verifies drafts, and asks the proposer for the next drafts."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specserve.engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from specserve.engine.request import Request
from specserve.models.layers.attention import AttentionBackend, AttentionMetadata
from specserve.models.llama import LlamaForCausalLM
from specserve.sample.sampler import Sampler, SamplingRow

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_logits] rows of the hidden states to project
    logits_rows: list[tuple[ScheduledRequest, int, int]]  # (request, first logits row, count)


def batch_metadata(query_lens: list[int], seq_lens: list[int], tables: list[list[int]], block_size: int,
                   device: torch.device, pad_block_table_to: int = 0) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions [num_tokens] and attention metadata of a flat ragged batch: request i computes the
    last query_lens[i] of its seq_lens[i] tokens, whose KV lives in the blocks tables[i]."""
    num_reqs = len(query_lens)
    max_blocks = max(max(len(t) for t in tables), pad_block_table_to)
    block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
    q_lens = torch.tensor(query_lens, dtype=torch.int32)
    cu = torch.zeros(num_reqs + 1, dtype=torch.int32)
    cu[1:] = q_lens.cumsum(0)
    s_lens = torch.tensor(seq_lens, dtype=torch.int32)
    num_tokens = int(cu[-1])
    req_of_token = torch.repeat_interleave(torch.arange(num_reqs), q_lens.long())
    positions = (torch.arange(num_tokens) - cu[:-1].long()[req_of_token]
                 + (s_lens - q_lens).long()[req_of_token])
    slots = (block_tables[req_of_token, positions // block_size].long() * block_size
             + positions % block_size)
    meta = AttentionMetadata(
        num_reqs=num_reqs, num_tokens=num_tokens, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc=cu.to(device), seq_lens=s_lens.to(device),
        block_tables=block_tables.to(device), slot_mapping=slots.to(device),
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, extra={"block_size": block_size})
    return positions.to(device), meta


def build_step_inputs(scheduled: list[ScheduledRequest], block_size: int, device: torch.device,
                      pad_block_table_to: int = 0) -> StepInputs:
    """Flat token ids / positions / slots and the attention metadata of one step."""
    input_ids: list[int] = []
    query_lens, seq_lens, tables = [], [], []
    logits_idx: list[int] = []
    logits_rows = []
    for s in scheduled:
        req = s.request
        num_real = s.num_tokens - len(s.spec_token_ids)
        input_ids += req.all_token_ids[s.start:s.start + num_real]
        input_ids += s.spec_token_ids
        query_lens.append(s.num_tokens)
        seq_lens.append(s.start + s.num_tokens)
        tables.append(s.block_ids)
        if s.sample:
            count = 1 + len(s.spec_token_ids)
            end = len(input_ids)
            logits_rows.append((s, len(logits_idx), count))
            logits_idx += range(end - count, end)
    positions, meta = batch_metadata(query_lens, seq_lens, tables, block_size, device, pad_block_table_to)
    return StepInputs(input_ids=torch.tensor(input_ids, dtype=torch.long).to(device),
                      positions=positions, meta=meta,
                      logits_indices=torch.tensor(logits_idx, dtype=torch.long).to(device),
                      logits_rows=logits_rows)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, device: torch.device,
                 dtype: torch.dtype, block_size: int, num_blocks: int, seed: int = 0) -> None:
        self.model = model
        self.backend = backend
        model.backend = backend
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        cfg = model.cfg
        # one tensor for all layers: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads,
                                    cfg.head_dim, dtype=dtype, device=device)
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.graphs = None  # DecodeGraphs, when CUDA graphs are enabled
        # every tensor indexed by block id in dim 2 (the target's KV, a draft model's KV): CoW copies all
        self.block_tensors: list[torch.Tensor] = [self.kv_cache]
        self.proposer = None  # set by the engine when speculating (specserve.spec.Proposer)
        self.rejection_sampler = None
        torch.manual_seed(seed)

    @staticmethod
    def kv_bytes_per_block(cfg, block_size: int, dtype: torch.dtype) -> int:
        return cfg.kv_bytes_per_token(torch.tensor([], dtype=dtype).element_size()) * block_size

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy whole KV blocks src -> dst in every layer (all reads before writes)."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for t in self.block_tensors:
            t[:, :, dst] = t[:, :, src]

    def _generator(self, req_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        g = self.generators.get(req_id)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(seed)
            self.generators[req_id] = g
        return g

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in sched.finished_req_ids:
            self.generators.pop(req_id, None)
        if self.proposer is not None:
            self.proposer.begin_step(sched)
        out = ModelRunnerOutput()
        if sched.is_empty:
            return out
        self.copy_blocks(sched.block_copies)
        inputs = build_step_inputs(sched.scheduled, self.block_size, self.device)
        hidden = self._forward(inputs)
        if inputs.logits_rows:
            self._sample(inputs, hidden, out)
        if self.proposer is not None:  # also without logits: a draft model follows every prefill chunk
            out.draft_token_ids = self.proposer.propose(self, sched, inputs, hidden, out)
        return out

    def _sample(self, inputs: StepInputs, hidden: torch.Tensor, out: ModelRunnerOutput) -> None:
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [num_logits, V] fp32
        # a request about to fork (SamplingParams.n > 1) samples each child's first token from its
        # own logits row, with the child's own generator
        plain = [(req, row) for s, row, count in inputs.logits_rows if not s.spec_token_ids
                 for req in (s.request, *s.request.forks)]
        if plain:
            rows = [self._sampling_row(req) for req, _ in plain]
            idx = torch.tensor([row for _, row in plain], device=self.device)
            tokens, logprobs = self.sampler(logits[idx], rows)
            for (req, _), token, lp in zip(plain, tokens, logprobs):
                out.sampled_token_ids[req.request_id] = [token]
                if lp is not None:
                    out.logprobs[req.request_id] = [lp]
        verify = [(s, row, count) for s, row, count in inputs.logits_rows if s.spec_token_ids]
        if verify:
            self.rejection_sampler.verify(self, logits, verify, out)

    def enable_cuda_graphs(self, max_model_len: int, max_num_seqs: int, query_lens: tuple[int, ...] = (1,)
                           ) -> None:
        """Capture decode (and, with `query_lens` 1 + k, verification) step graphs for the target and a
        draft model's decode steps (needs a graph-safe attention backend: triton)."""
        from specserve.engine.cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.device, self.block_size, max_model_len,
                                   max_num_seqs, query_lens)
        self.graphs.capture()
        draft = getattr(self.proposer, "model", None)
        if draft is not None and hasattr(self.proposer, "kv_caches"):
            # its catch-up forwards (bonus token + accepted drafts) are 1 + k tokens at most, like a verification
            self.proposer.graphs = DecodeGraphs(draft, self.proposer.kv_caches, self.device, self.block_size,
                                                max_model_len, max_num_seqs, query_lens)
            self.proposer.graphs.capture()

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(inputs.meta):
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        self.backend.prepare(inputs.meta)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)

    def _sampling_row(self, req: Request) -> SamplingRow:
        return SamplingRow(params=req.sampling_params, prompt_token_ids=req.prompt_token_ids,
                           output_token_ids=req.output_token_ids,
                           generator=self._generator(req.request_id, req.sampling_params.seed),
                           eos_token_ids=req.eos_token_ids)
