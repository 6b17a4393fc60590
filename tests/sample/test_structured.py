"""Structured outputs below the engine: constraint checks, the compiler's cache, grammar masks in the
sampler (mixed batches, penalties, logit bias) and in the rejection sampler (each verified position
masked, a draft the grammar refuses is rejected, the masked target distribution kept exactly)."""
from __future__ import annotations

import json
import string

import pytest
import torch

from specserve.sample.sampler import Sampler, SamplingRow
from specserve.sample.grammars import check_constraint
from specserve.sample.structured import GrammarCompiler
from specserve.sampling_params import SamplingParams
from specserve.sampling_params import StructuredOutputsParams as Constraint
from specserve.spec_decode.rejection import RejectionSampler, VerifyRequest

EOS = 2
VOCAB = 128  # the model's vocabulary: larger than the tokenizer's 99 ids (the rest must never be allowed)
GREEDY = SamplingParams(temperature=0.0)
# the masks are applied where the logits are: xgrammar's CPU kernel, or its Triton kernel on a GPU
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


@pytest.fixture(scope="module")
def char_tokenizer():
    """ids 0..2 = unk, bos, eos; then one printable character per id."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = list(string.ascii_letters + string.digits + string.punctuation + " \n")
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"] + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def compiler(char_tokenizer):
    c = GrammarCompiler(char_tokenizer, VOCAB, [EOS])
    yield c
    c.shutdown()


def tid(tok, ch: str) -> int:
    return tok.convert_tokens_to_ids(ch)


def row(params: SamplingParams, grammar=None, seed: int | None = None, out=(), device="cpu") -> SamplingRow:
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    return SamplingRow(params, [1], list(out), gen, frozenset({EOS}), grammar)


def allowed(grammar, vocab: int = VOCAB) -> set[int]:
    """The token ids the grammar allows next (through the same mask the sampler applies)."""
    from specserve.sample.structured import GrammarMasks

    masks = GrammarMasks()
    bitmask = masks.buffer(1, vocab)
    grammar.fill(bitmask, 0)
    logits = torch.zeros(1, vocab)
    masks.apply(logits, bitmask, [0])
    return set((logits[0] == 0).nonzero().flatten().tolist())


# -- constraints ---------------------------------------------------------------------------------
@pytest.mark.parametrize("constraint,problem", [
    (Constraint(json={"type": "foo"}), "invalid JSON schema: Unsupported type"),
    (Constraint(json="{not json"), "invalid JSON schema"),
    (Constraint(regex="[a-"), "invalid regex: Regex parsing error at position 4"),
    (Constraint(grammar="root ::= item"), "invalid grammar: EBNF parser error at line 1"),
])
def test_invalid_constraints_name_the_problem(constraint, problem):
    with pytest.raises(ValueError, match="^" + problem.replace("(", r"\(")) as e:
        check_constraint(constraint)
    assert "/project/" not in str(e.value) and ".cc:" not in str(e.value)  # no C++ source locations


def test_constraint_params_take_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        Constraint(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, structured_outputs=Constraint(regex="a+"))


def test_compiler_caches_by_constraint_and_reports_failures(compiler):
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    first = compiler.submit(Constraint(json=schema))
    assert compiler.submit(Constraint(json=dict(schema))) is first  # same constraint: one compilation
    grammar = compiler.matcher(first.result())
    for ch in '{"b": ':  # the schema's property order is the output's
        assert not grammar.accept(tid(compiler.tokenizer, ch))
    bad = compiler.submit(Constraint(regex="(unclosed"))
    with pytest.raises(ValueError, match="structured_outputs: invalid regex"):
        bad.result()


# -- the sampler ---------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_masks_only_constrained_rows(compiler, char_tokenizer, device):
    tok = char_tokenizer
    g = compiler.compile(Constraint(choice=["yes", "no"]))
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)).to(device)
    logits[:, tid(tok, "x")] = 20.0  # every row's favourite is a token the grammar refuses
    hot = SamplingParams(temperature=1.0)
    rows = [row(GREEDY, compiler.matcher(g)), row(GREEDY), row(hot, compiler.matcher(g), seed=1, device=device),
            row(hot, seed=2, device=device)]
    tokens, _ = Sampler()(logits.clone(), rows)
    first = {tid(tok, "y"), tid(tok, "n")}
    assert tokens[0] in first and tokens[2] in first
    assert tokens[0] == max(first, key=lambda t: logits[0, t])  # greedy: the argmax among allowed tokens
    # unconstrained rows sample exactly as in a batch without grammars
    alone, _ = Sampler()(logits.clone(), [row(GREEDY), row(GREEDY), row(hot, seed=1, device=device),
                                          row(hot, seed=2, device=device)])
    assert tokens[1] == alone[1] == tid(tok, "x") and tokens[3] == alone[3]


def test_penalties_and_logit_bias_act_inside_the_mask(compiler, char_tokenizer):
    tok = char_tokenizer
    g = compiler.compile(Constraint(regex="[abc]+"))
    logits = torch.zeros(1, VOCAB)
    logits[0, tid(tok, "a")] = 2.0
    bias_out = SamplingParams(temperature=0.0, logit_bias={tid(tok, "z"): 100.0})  # refused by the grammar
    assert Sampler()(logits.clone(), [row(bias_out, compiler.matcher(g))])[0] == [tid(tok, "a")]
    bias_in = SamplingParams(temperature=0.0, logit_bias={tid(tok, "c"): 5.0})
    assert Sampler()(logits.clone(), [row(bias_in, compiler.matcher(g))])[0] == [tid(tok, "c")]
    # a's repetition penalty (seen in the output) lets b win
    rep = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=2.0)
    logits[0, tid(tok, "b")] = 1.5
    grammar = compiler.matcher(g)
    grammar.accept(tid(tok, "a"))
    assert Sampler()(logits.clone(), [row(rep, grammar, out=[tid(tok, "a")])])[0] == [tid(tok, "b")]


def test_padding_ids_past_the_tokenizer_are_never_allowed(compiler):
    grammar = compiler.matcher(compiler.compile(Constraint(regex="[a-z]*")))
    ids = allowed(grammar)
    assert ids and max(ids) < 99 and EOS in ids  # [a-z]* may end at once: eos is allowed


def test_sampling_to_the_end_gives_valid_json_and_stops(char_tokenizer, compiler):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "tag": {"enum": ["red", "blue"]}},
              "required": ["n", "tag"], "additionalProperties": False}
    grammar = compiler.matcher(compiler.compile(Constraint(json=schema)))
    sampler, gen, out = Sampler(), torch.Generator().manual_seed(5), []
    params = SamplingParams(temperature=1.0, seed=5)
    for _ in range(60):
        logits = torch.randn(1, VOCAB, generator=gen) * 3
        (token,), _ = sampler(logits, [SamplingRow(params, [1], out, gen, frozenset({EOS}), grammar)])
        out.append(token)
        if grammar.accept(token):
            break
    assert grammar.ended and out[-1] == EOS
    value = json.loads(char_tokenizer.decode(out[:-1]))
    assert set(value) == {"n", "tag"} and 0 <= value["n"] <= 99 and value["tag"] in ("red", "blue")


# -- the rejection sampler -----------------------------------------------------------------------
def peaked(tokens: list[int], high: float = 10.0) -> torch.Tensor:
    logits = torch.zeros(len(tokens), VOCAB)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = high
    return logits


def vreq(drafts: list[int], grammar, params: SamplingParams = GREEDY, first_row: int = 0, seed=None):
    return VerifyRequest(first_row, drafts, row(params, grammar, seed=seed))


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_verification_rejects_a_draft_the_grammar_refuses(compiler, char_tokenizer, device):
    tok = char_tokenizer
    t = lambda ch: tid(tok, ch)  # noqa: E731
    grammar = compiler.matcher(compiler.compile(Constraint(regex="ab[cd]e")))
    # the target's raw argmax agrees with every draft, but "x" breaks the grammar at position 2
    logits = peaked([t("a"), t("b"), t("x"), t("e")])
    logits[2, t("d")] = 5.0  # the best token the grammar allows there
    before = allowed(grammar)
    res = RejectionSampler().sample(logits.to(device), [vreq([t("a"), t("b"), t("x")], grammar)])
    assert res.token_ids == [[t("a"), t("b"), t("d")]] and res.num_accepted == [2]
    assert allowed(grammar) == before and grammar.num_accepted == 0  # the walk through the drafts was rolled back


def test_verification_masks_every_position_in_a_mixed_batch(compiler, char_tokenizer):
    tok = char_tokenizer
    t = lambda ch: tid(tok, ch)  # noqa: E731
    grammar = compiler.matcher(compiler.compile(Constraint(regex="[0-9]+")))
    # request 0 (constrained, no matching drafts): its rows favour letters; request 1 is unconstrained
    logits = torch.cat([peaked([t("q"), t("q")]), peaked([t("q"), t("r")])])
    logits[0, t("7")] = 3.0
    res = RejectionSampler().sample(logits, [vreq([t("q")], grammar), vreq([t("q")], None, first_row=2)])
    assert res.token_ids == [[t("7")], [t("q"), t("r")]] and res.num_accepted == [0, 1]


def test_a_stop_token_draft_ends_the_walk(compiler, char_tokenizer):
    tok = char_tokenizer
    grammar = compiler.matcher(compiler.compile(Constraint(choice=["ok"])))
    drafts = [tid(tok, "o"), tid(tok, "k"), EOS, tid(tok, "o")]
    res = RejectionSampler().sample(peaked(drafts + [tid(tok, "k")]), [vreq(drafts, grammar)])
    assert res.token_ids[0][:3] == [tid(tok, "o"), tid(tok, "k"), EOS] and res.num_accepted == [3]


@pytest.mark.parametrize("device", DEVICES)
def test_random_verification_keeps_the_masked_target_distribution(compiler, char_tokenizer, device):
    """Drafts the grammar refuses ("x") or allows ("a") under a target that puts most mass on refused
    tokens: the first emitted token must follow the target restricted to the grammar ([abc])."""
    tok = char_tokenizer
    ids = [tid(tok, c) for c in "abc"]
    g = compiler.compile(Constraint(regex="[abc]z"))
    logits_row = torch.full((VOCAB,), -4.0)
    logits_row[ids] = torch.tensor([0.5, 1.5, 0.0])
    logits_row[tid(tok, "x")] = 4.0
    p = logits_row[ids].softmax(-1)
    hot = SamplingParams(temperature=1.0)
    trials = 1500
    for draft in ("x", "a"):
        reqs = [vreq([tid(tok, draft)], compiler.matcher(g), hot, first_row=2 * i) for i in range(trials)]
        logits = logits_row.repeat(2 * trials, 1).to(device)
        torch.manual_seed(0)
        res = RejectionSampler().sample(logits, reqs)
        firsts = torch.tensor([r[0] for r in res.token_ids])
        freq = torch.stack([(firsts == i).float().mean() for i in ids])
        assert freq.sum() == 1.0  # never a refused token
        assert 0.5 * (freq - p).abs().sum() < 0.04, (draft, freq, p)
        if draft == "x":
            assert res.num_accepted == [0] * trials
