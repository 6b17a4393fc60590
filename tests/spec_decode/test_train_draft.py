"""`specserve train-draft`: a head trained on a tiny random target with a character tokenizer."""
from __future__ import annotations

import io
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from specserve.cli import main
from specserve.engine.step_inputs import batch_metadata
from specserve.models.layers.attention import get_attention_backend
from specserve.models.loader import load_model
from specserve.spec_decode import train_data
from specserve.spec_decode.eagle_head import load_head, target_weights
from specserve.spec_decode.train import (STATE_FILE, SUMMARY_FILE, TrainConfig, build_head, learning_rate,
                                        batch_loss, train)
from specserve.spec_decode.train_eval import EvalSet, acceptance
from specserve.spec_decode.train_target import TargetFeatures
from tests.server.harness import add_char_tokenizer

WORDS = "the cat sat on a mat and then it ran to the big red house where a dog slept all day".split()
DEPTH = 3


@pytest.fixture(scope="module")
def chat_target(tiny_llama_dir, tmp_path_factory) -> Path:
    return add_char_tokenizer(tiny_llama_dir, tmp_path_factory.mktemp("train-target"))


def _conversations(num: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    records = []
    for i in range(num):
        turns = []
        for _ in range(rng.randint(1, 2)):
            turns += [{"from": "human", "value": text(2, 5)}, {"from": "gpt", "value": text(4, 10)}]
        records.append({"id": str(i), "conversations": turns})
    return records


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("train-data") / "chats.json"
    path.write_text(json.dumps(_conversations(14)))
    return path


def _config(target: Path, data: Path, out: Path, **overrides) -> TrainConfig:
    options = dict(max_len=64, eval_conversations=4, batch_size=2, max_steps=5, ttt_depth=DEPTH, lr=3e-3,
                   eval_every=2, save_every=2, device="cpu", seed=3, save_dtype="float32", fuse_layers="none")
    return TrainConfig(str(target), str(data), str(out), **{**options, **overrides})


@pytest.fixture(scope="module")
def trained(chat_target, chat_data, tmp_path_factory) -> tuple[TrainConfig, dict]:
    cfg = _config(chat_target, chat_data, tmp_path_factory.mktemp("train-out") / "head")
    progress = io.StringIO()
    summary = train(cfg, stream=progress)
    assert "step 2: held-out mean acceptance length" in progress.getvalue()
    return cfg, summary


def test_data_masks_the_assistant_tokens(chat_target, tmp_path):
    """ShareGPT with a broken tail and OpenAI messages in JSONL: the labels are exactly the answers."""
    tok = load_model(str(chat_target), device=torch.device("cpu"), dtype="float32").tokenizer
    good = json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "a cat"},
                                         {"from": "human", "value": "and?"}, {"from": "gpt", "value": "a dog"}]})
    broken = tmp_path / "cut.json"
    broken.write_text(f'[{good},\n {{"conversations": [{{"from": "human", "val')
    lines = tmp_path / "chats.jsonl"
    lines.write_text(json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": "yo"},
                                              {"role": "assistant", "content": "sup"}]}) + "\n"
                     + json.dumps({"messages": [{"role": "user", "content": "no answer"}]}) + "\n")
    [cut] = train_data.read_conversations(broken)
    [msgs] = train_data.read_conversations(lines)
    assert [m["role"] for m in cut] == ["user", "assistant", "user", "assistant"]
    for convo, answers in ((cut, [" a cat", " a dog"]), (msgs, [" sup"])):
        [seq] = train_data.render_all(tok, [convo], max_len=200)
        ids = seq.token_ids
        labelled = tok.decode(ids[1:][seq.labels[:-1]].tolist())
        assert labelled == "".join(answers)
    [short] = train_data.render_all(tok, [cut], max_len=21)  # truncation keeps the answer's first tokens
    assert len(short.token_ids) == 21 and tok.decode(short.token_ids[1:][short.labels[:-1]].tolist()) == " a"


def test_draft_vocabulary_is_the_most_frequent_labels_and_eos():
    counts = {5: 10, 7: 30, 9: 20, 11: 1}
    ids, coverage = train_data.draft_vocabulary(counts, 3, 16, eos_token_ids=[2])
    assert ids == [2, 7, 9] and coverage == pytest.approx(50 / 61)
    with pytest.raises(ValueError, match="out of range: 1..16"):
        train_data.draft_vocabulary(counts, 17, 16, [2])


def test_training_lowers_the_loss_and_saves_a_loadable_head(trained, chat_target):
    cfg, summary = trained
    out = Path(cfg.out)
    loaded = load_model(str(chat_target), device=torch.device("cpu"), dtype="float32")
    head = load_head(out, dtype=torch.float32, device=torch.device("cpu"), max_positions=64)
    head.attach(*target_weights(loaded, torch.device("cpu"), torch.float32))
    assert head.draft_vocab_size == summary["draft_vocab"]["size"] == 320  # the whole tiny vocabulary
    assert summary["steps"] == 5 and summary["stopped"] == "done" and len(summary["loss_history"]) == 5
    # the same sequences score a lower loss under the trained head than under the head it started as
    seqs = [s for s in train_data.render_all(loaded.tokenizer, train_data.read_conversations(Path(cfg.data))[:10],
                                             64) if s is not None]
    start = build_head(loaded, head.draft_vocab, 64, cfg.init, torch.device("cpu"), cfg.seed)
    features = TargetFeatures(loaded, torch.device("cpu"), 64, head.draft_vocab)

    def mean_loss(h) -> float:
        total = 0.0
        with torch.no_grad():
            for s in seqs:
                ids, hidden, logp = features.labelled(s)
                total += float(batch_loss(h, ids, hidden, logp, [s], DEPTH))
        return total / len(seqs)

    assert mean_loss(head) < mean_loss(start) - 0.05
    # the estimate: held-out chains, 1 <= length <= 1 + k, positions never more likely further on, and
    # the saved head reproduces it
    est = summary["acceptance"]
    assert est["k"] == DEPTH and est["num_chains"] > 50 and 1.0 <= est["mean_acceptance_length"] <= 1 + DEPTH
    assert all(a >= b for a, b in zip(est["per_position"], est["per_position"][1:]))
    held_out = train_data.render_all(loaded.tokenizer, train_data.read_conversations(Path(cfg.data))[-4:], 64)
    again = acceptance(head, EvalSet([s for s in held_out if s is not None], features), DEPTH)
    assert again.as_dict() == est
    written = json.loads((out / SUMMARY_FILE).read_text())
    assert written["data"]["train_conversations"] == 10 and written["data"]["eval_conversations"] == 4
    assert written["draft_vocab"]["coverage"] == 1.0 and written["device"] == "cpu"


def test_estimate_is_chain_drafting_through_the_kv_cache(trained, chat_target):
    """The estimate's training-time-test replay equals drafting with the head's inference forward
    (its own KV cache, one entry per step, its own output as the next hidden input)."""
    cfg, _ = trained
    cpu = torch.device("cpu")
    loaded = load_model(str(chat_target), device=cpu, dtype="float32")
    head = load_head(cfg.out, dtype=torch.float32, device=cpu, max_positions=64)
    head.attach(*target_weights(loaded, torch.device("cpu"), torch.float32))
    head.backend = get_attention_backend("torch", cpu)
    features = TargetFeatures(loaded, cpu, 64, head.draft_vocab)
    [seq] = train_data.render_all(loaded.tokenizer, train_data.read_conversations(Path(cfg.data))[-1:], 64)
    ids, hidden, target_argmax = features.greedy(seq)
    n = len(ids)
    with torch.no_grad():
        replay = head.train_forward(ids, hidden, DEPTH)
        shifted = torch.cat([torch.zeros_like(hidden[:1]), hidden[:-1]])
        for m in range(0, n - DEPTH + 1, 7):
            kv = [torch.zeros(2, 8, 16, head.cfg.num_kv_heads, head.cfg.head_dim)]
            g = _head_step(head, kv, ids[:m + 1], shifted[:m + 1], m + 1)[-1:]
            for d in range(DEPTH):
                if d:
                    g = _head_step(head, kv, ids[m + d:m + d + 1], g, m + d + 1)
                torch.testing.assert_close(g[0], replay[d][m + d], atol=2e-5, rtol=1e-4)


def _head_step(head, kv, token_ids, hidden, seq_len: int) -> torch.Tensor:
    positions, meta, _ = batch_metadata([len(token_ids)], [seq_len], [list(range(8))], 16, torch.device("cpu"))
    head.backend.prepare(meta)
    return head(token_ids, positions, kv, meta, hidden)


def test_resume_continues_the_same_run(trained, chat_target, chat_data, tmp_path):
    cfg, summary = trained
    out = tmp_path / "resumed"
    devnull = io.StringIO()
    first = train(_config(chat_target, chat_data, out, stop_after_steps=3), stream=devnull)
    assert first["steps"] == 3 and first["stopped"] == "stop_after_steps"
    assert load_head(out, dtype=torch.float32, device=torch.device("cpu"), max_positions=64) is not None
    rest = train(_config(chat_target, chat_data, out, resume=True), stream=devnull)
    assert rest["steps"] == 5 and rest["steps_this_run"] == 2
    np.testing.assert_allclose(rest["loss_history"], summary["loss_history"], rtol=1e-5)
    ours = torch.load(out / STATE_FILE, weights_only=False)["head"]
    theirs = torch.load(Path(cfg.out) / STATE_FILE, weights_only=False)["head"]
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, atol=1e-6, rtol=1e-5)
    assert rest["acceptance"] == summary["acceptance"]


def test_bad_inputs_give_clear_errors(trained, chat_target, chat_data, tmp_path):
    cfg, _ = trained
    devnull = io.StringIO()
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps([{"conversations": [{"from": "human", "value": "only a question"}]}] * 3))
    cases = [
        (_config(tmp_path / "no" / "such" / "model", chat_data, tmp_path / "a"), "model not found"),
        (_config(chat_target, tmp_path / "missing.json", tmp_path / "b"), "data file not found"),
        (_config(chat_target, empty, tmp_path / "c", eval_conversations=0), "no usable conversations"),
        (_config(chat_target, chat_data, tmp_path / "d", draft_vocab_size=1000), "out of range: 1..320"),
        (_config(chat_target, chat_data, tmp_path / "e", max_len=4096), "exceeds the target's 512"),
        (_config(chat_target, chat_data, tmp_path / "f", resume=True), "holds no checkpoint"),
        (_config(chat_target, chat_data, cfg.out), "already holds a training checkpoint"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            train(bad, stream=devnull)
    other = tmp_path / "other"
    shutil.copytree(cfg.out, other)
    with pytest.raises(ValueError, match="another target or shape.*draft_vocab_size 320, this run 100"):
        train(_config(chat_target, chat_data, other, draft_vocab_size=100, resume=True), stream=devnull)
    with pytest.raises(ValueError, match="--batch-size 3 \\(checkpoint: 2\\)"):
        train(_config(chat_target, chat_data, other, batch_size=3, resume=True), stream=devnull)
    with pytest.raises(ValueError, match="--ttt-depth must be at least 1"):
        _config(chat_target, chat_data, tmp_path / "g", ttt_depth=0)


def test_cli_trains_and_prints_progress(chat_target, chat_data, tmp_path, capsys):
    out = tmp_path / "cli-head"
    cmd = [sys.executable, "-m", "specserve.cli", "train-draft", str(chat_target), "--data", str(chat_data),
           "--out", str(out), "--max-steps", "2", "--batch-size", "2", "--eval-conversations", "2",
           "--eval-every", "1", "--max-len", "48", "--device", "cpu", "--threads", "1", "--ttt-depth", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step 1: held-out mean acceptance length" in proc.stderr and "step 2/2 loss" in proc.stderr
    assert f"{out}: 2 steps" in proc.stdout and "held-out mean acceptance length" in proc.stdout
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["command"][:3] == ["specserve", "train-draft", str(chat_target)]
    assert summary["steps"] == 2
    weights = load_file(str(out / "model.safetensors"))  # the default: the head's weights in bf16
    assert weights["fc.weight"].dtype == torch.bfloat16 and weights["draft_vocab"].dtype == torch.int64
    # the default fuses the target's layers (auto: layer 0 of the two-layer target)
    assert json.loads((out / "config.json").read_text())["aux_layers"] == [0] and "fuse.weight" in weights
    assert main(cmd[3:5] + ["--data", str(tmp_path / "nope.json"), "--out", str(tmp_path / "x")]) == 2
    assert "specserve: error: data file not found" in capsys.readouterr().err


def test_regenerate_trains_on_the_targets_own_answers(chat_target, chat_data, tmp_path):
    """--regenerate: each conversation becomes its first prompt and the target's greedy answer (the
    engine's own output for that prompt), made once; --resume reads the same answers back."""
    from specserve import LLM, SamplingParams

    out = tmp_path / "regen"
    devnull = io.StringIO()
    cfg = _config(chat_target, chat_data, out, regenerate=True, regenerate_max_tokens=6, stop_after_steps=1,
                  dtype="float32")
    first = train(cfg, stream=devnull)
    assert "regenerating 14 answers with the target" in devnull.getvalue()
    saved = json.loads((out / "regenerated.json").read_text())
    assert len(saved["train"]) + len(saved["eval"]) == first["data"]["conversations_read"] == 14
    original = {r["conversations"][0]["value"]: r for r in _conversations(14)}
    llm = LLM(str(chat_target), device="cpu", dtype="float32", max_model_len=64)
    for messages in saved["train"] + saved["eval"]:
        assert [m["role"] for m in messages] == ["user", "assistant"] and messages[0]["content"] in original
        text = llm.tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        answer = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=6))[0]
        assert messages[1]["content"] == answer.outputs[0].text
    llm.shutdown()
    stamp = (out / "regenerated.json").stat().st_mtime_ns
    rest = train(_config(chat_target, chat_data, out, regenerate=True, regenerate_max_tokens=6, resume=True,
                         dtype="float32"),
                 stream=devnull)
    assert rest["steps"] == 5 and (out / "regenerated.json").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="--regenerate-max-tokens 7 \\(checkpoint: 6\\)"):
        train(_config(chat_target, chat_data, out, regenerate=True, regenerate_max_tokens=7, resume=True,
                         dtype="float32"),
              stream=devnull)
    # another run's regenerated.json as --data: its answers, its own held-out split
    log = io.StringIO()
    reuse = train(_config(chat_target, str(out / "regenerated.json"), tmp_path / "reuse", stop_after_steps=1,
                          dtype="float32"), stream=log)
    assert f"is a regenerated.json: {len(saved['train'])} answers to train on, its {len(saved['eval'])} held-out" \
        in log.getvalue()
    assert reuse["data"]["conversations_read"] == 14 and reuse["data"]["eval_conversations"] == len(saved["eval"]) == 4
    assert reuse["data"]["train_conversations"] + reuse["data"]["train_skipped"] == len(saved["train"]) == 10
    with pytest.raises(ValueError, match="leave --regenerate off"):
        train(_config(chat_target, str(out / "regenerated.json"), tmp_path / "again", regenerate=True,
                      dtype="float32"), stream=log)


def test_regenerate_turns_answers_the_datas_next_prompts_after_the_targets_own_answers(chat_target, tmp_path):
    """--regenerate-turns 2: after the target's answer to the first prompt comes the data's next user
    turn and the target's answer to that conversation (the data's answers are never read); a
    conversation whose next prompt does not fit in --max-len, or that has no further turn, keeps
    one answer; --resume refuses another --regenerate-turns."""
    from specserve import LLM, SamplingParams

    records = _conversations(16, seed=5)
    long_turn = {"from": "human", "value": " ".join(WORDS * 3)}  # never fits beside an answer in 96 tokens
    records[0]["conversations"] = records[0]["conversations"][:2] + [long_turn, {"from": "gpt", "value": "x"}]
    data = tmp_path / "chats.json"
    data.write_text(json.dumps(records))
    out, log = tmp_path / "regen", io.StringIO()
    train(_config(chat_target, data, out, regenerate=True, regenerate_max_tokens=6, regenerate_turns=2,
                  stop_after_steps=1, max_len=96, dtype="float32"), stream=log)
    assert "regenerating 16 answers to turn 1 (of at most 2) with the target" in log.getvalue()
    saved = json.loads((out / "regenerated.json").read_text())
    convs = saved["train"] + saved["eval"]
    by_prompt = {r["conversations"][0]["value"]: r["conversations"] for r in records}
    llm = LLM(str(chat_target), device="cpu", dtype="float32", max_model_len=96)

    def answer(messages: list[dict]) -> str:
        text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        return llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=6))[0].outputs[0].text

    two = 0
    for messages in convs:
        data_turns = by_prompt[messages[0]["content"]]
        data_users = [t["value"] for t in data_turns if t["from"] == "human"]
        assert [m["role"] for m in messages] in (["user", "assistant"], ["user", "assistant"] * 2)
        assert messages[1]["content"] == answer(messages[:1])
        if len(messages) == 4:
            two += 1
            assert messages[2]["content"] == data_users[1] and messages[3]["content"] == answer(messages[:3])
        else:
            assert len(data_users) == 1 or data_users[1] == long_turn["value"]
    llm.shutdown()
    assert len(convs) == 16 and two == sum(len(r["conversations"]) == 4 for r in records[1:]) > 0
    assert f"regenerating {two} answers to turn 2 (of at most 2)" in log.getvalue()
    with pytest.raises(ValueError, match="--regenerate-turns 3 \\(checkpoint: 2\\)"):
        train(_config(chat_target, data, out, regenerate=True, regenerate_max_tokens=6, regenerate_turns=3,
                      resume=True, max_len=96, dtype="float32"), stream=log)
    with pytest.raises(ValueError, match="--regenerate-turns applies to --regenerate"):
        _config(chat_target, data, out, regenerate_turns=2)


def test_time_budget_anneals_the_learning_rate():
    """With --max-minutes the cosine reaches 0 when the time runs out, even if steps remain."""
    assert learning_rate(50, 1.0, 10, 100) == pytest.approx(0.5 * (1 + np.cos(np.pi * 40 / 90)))
    assert learning_rate(50, 1.0, 10, 100, time_fraction=0.9) == pytest.approx(0.5 * (1 + np.cos(np.pi * 0.9)))
    assert learning_rate(50, 1.0, 10, 100, time_fraction=1.2) == pytest.approx(0.0)
    assert learning_rate(90, 1.0, 10, 100, time_fraction=0.1) < learning_rate(50, 1.0, 10, 100)


def test_one_target_forward_per_step_gives_each_sequences_own_labels(chat_target):
    """The step's sequences go through the target together (one ragged forward, packed end to end);
    each gets what a forward of it alone gives."""
    loaded = load_model(str(chat_target), device=torch.device("cpu"), dtype="float32")
    seqs = [s for s in train_data.render_all(loaded.tokenizer, [train_data._messages(r) for r in
                                                                 _conversations(5, seed=7)], 64) if s is not None]
    vocab = torch.arange(loaded.arch.vocab_size)
    features = TargetFeatures(loaded, torch.device("cpu"), 64, vocab, max_batch=len(seqs))
    packed = features.labelled_batch(seqs)
    alone = [features.labelled(s) for s in seqs]
    for ours, theirs in zip(packed, zip(*alone)):
        torch.testing.assert_close(ours, torch.cat(theirs), atol=1e-5, rtol=1e-5)


def test_label_temperature_sharpens_the_targets_distribution(chat_target, chat_data, tmp_path):
    """--label-temperature T: the label is softmax(logits / T) over the full vocabulary read at the
    draft columns; 0 is the target's argmax, one-hot. A run keeps its T (a resume with another is refused)."""
    loaded = load_model(str(chat_target), device=torch.device("cpu"), dtype="float32")
    draft = torch.arange(0, loaded.arch.vocab_size, 2)  # half the vocabulary: mass outside is dropped
    logits = torch.randn(6, loaded.arch.vocab_size) * 3
    labels = {t: TargetFeatures(loaded, torch.device("cpu"), 64, draft, label_temperature=t).label_logp(logits)
              for t in (1.0, 0.5, 0.0)}
    torch.testing.assert_close(labels[1.0], torch.log_softmax(logits, -1)[:, draft])
    torch.testing.assert_close(labels[0.5], torch.log_softmax(2 * logits, -1)[:, draft])
    one_hot = labels[0.0].exp()
    argmax = logits.argmax(-1)
    inside = argmax % 2 == 0  # rows whose argmax is a draft column
    assert torch.equal(one_hot.sum(-1), inside.float())
    assert torch.equal(one_hot[inside].argmax(-1), argmax[inside] // 2)
    devnull = io.StringIO()
    out = tmp_path / "hard"
    summary = train(_config(chat_target, chat_data, out, label_temperature=0.0, stop_after_steps=2), stream=devnull)
    assert summary["options"]["label_temperature"] == 0.0 and all(np.isfinite(summary["loss_history"]))
    with pytest.raises(ValueError, match="--label-temperature 1.0 \\(checkpoint: 0.0\\)"):
        train(_config(chat_target, chat_data, out, resume=True), stream=devnull)
    with pytest.raises(ValueError, match="--label-temperature must be a finite number >= 0"):
        _config(chat_target, chat_data, tmp_path / "bad", label_temperature=-1.0)


def test_a_packed_step_is_the_mean_over_its_sequences(chat_target):
    """The head's training pass over a step's sequences packed end to end gives each sequence what
    it gets alone (no attention across sequences, positions and hidden shift restart), and the
    step's loss is each depth's soft-CE averaged over all the step's chained label rows."""
    cpu = torch.device("cpu")
    loaded = load_model(str(chat_target), device=cpu, dtype="float32")
    seqs = [s for s in train_data.render_all(loaded.tokenizer, [train_data._messages(r) for r in
                                                                 _conversations(4, seed=11)], 64) if s is not None]
    assert len(seqs) >= 3 and len({len(s.token_ids) for s in seqs}) > 1, "want sequences of several lengths"
    head = build_head(loaded, torch.arange(loaded.arch.vocab_size), 64, "random", cpu, 5)
    features = TargetFeatures(loaded, cpu, 64, head.draft_vocab, max_batch=len(seqs))
    ids, hidden, logp = features.labelled_batch(seqs)
    with torch.no_grad():
        packed = head.train_forward(ids, hidden, DEPTH, [len(s.token_ids) for s in seqs])
        start = 0
        for s in seqs:
            n = len(s.token_ids)
            for d, alone in enumerate(head.train_forward(ids[start:start + n], hidden[start:start + n], DEPTH)):
                torch.testing.assert_close(packed[d][start:start + n], alone, atol=1e-5, rtol=1e-5)
            start += n
        # the loss: per depth, the CE summed over the sequences' chained rows over their number
        expected, rows, start = 0.0, 0, 0
        sums = np.zeros(DEPTH)
        for s in seqs:
            n, r = len(s.token_ids), s.num_label_rows
            outs = head.train_forward(ids[start:start + n], hidden[start:start + n], DEPTH)
            label_rows = np.flatnonzero(s.labels)
            for d, g in enumerate(outs):
                keep = label_rows >= d
                q = torch.log_softmax(head.compute_logits(g[torch.from_numpy(label_rows[keep])]), dim=-1)
                sums[d] += float(-(logp[rows:rows + r][torch.from_numpy(keep)].exp() * q).sum())
            start, rows = start + n, rows + r
        counts = [sum(int(s.labels[d:].sum()) for s in seqs) for d in range(DEPTH)]
        expected = sum(0.8 ** d * sums[d] / counts[d] for d in range(DEPTH))
        assert float(batch_loss(head, ids, hidden, logp, seqs, DEPTH)) == pytest.approx(expected, rel=1e-5)


def test_a_fused_head_starts_from_a_trained_head(trained, chat_target, chat_data, tmp_path):
    """--init HEAD_DIR --fuse-layers auto: the new head starts as that head (the same outputs over
    the same text, its draft vocabulary), fuses layer 0 once trained, and serves with method eagle3."""
    from specserve import LLM, SamplingParams
    from specserve.spec_decode import fuse_target_layers

    cfg, _ = trained
    cpu = torch.device("cpu")
    loaded = load_model(str(chat_target), device=cpu, dtype="float32")
    plain = load_head(cfg.out, dtype=torch.float32, device=cpu, max_positions=64)
    plain.attach(*target_weights(loaded, cpu, torch.float32))
    start = build_head(loaded, plain.draft_vocab, 64, cfg.out, cpu, 0, aux_layers=(0,))
    [seq] = train_data.render_all(loaded.tokenizer, train_data.read_conversations(Path(cfg.data))[-1:], 64)
    ids, hidden, _ = TargetFeatures(loaded, cpu, 64, plain.draft_vocab).labelled(seq)
    fuse_target_layers(loaded, (0,))
    _, wide, _ = TargetFeatures(loaded, cpu, 64, plain.draft_vocab).labelled(seq)
    assert wide.shape[1] == 2 * hidden.shape[1]
    with torch.no_grad():
        for a, b in zip(start.train_forward(ids, wide, DEPTH), plain.train_forward(ids, hidden, DEPTH)):
            torch.testing.assert_close(a, b)

    out = tmp_path / "fused"
    summary = train(_config(chat_target, chat_data, out, init=str(cfg.out), fuse_layers="auto", max_steps=3),
                    stream=io.StringIO())
    assert summary["steps"] == 3 and summary["options"]["fuse_layers"] == "auto"
    assert json.loads((out / "config.json").read_text())["aux_layers"] == [0]
    fused = load_head(out, dtype=torch.float32, device=cpu, max_positions=64)
    assert fused.aux_layers == (0,) and torch.equal(fused.draft_vocab, plain.draft_vocab)
    assert fused.fuse.weight[:, hidden.shape[1]:].abs().max() > 0, "the fused layer was not trained"
    prompts = [{"prompt_token_ids": [int(t) for t in seq.token_ids[:12]]}]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = LLM(str(chat_target), dtype="float32", device="cpu").generate(prompts, params)[0].outputs[0].token_ids
    llm = LLM(str(chat_target), dtype="float32", device="cpu", speculative_config={
        "method": "eagle3", "model": str(out), "num_speculative_tokens": 3, "adaptive": False})
    assert llm.generate(prompts, params)[0].outputs[0].token_ids == want
    assert llm.engine.stats()["spec_decode_num_drafts"] > 0


def test_bad_fuse_and_init_options_give_clear_errors(chat_target, chat_data, tmp_path):
    cases = [({"fuse_layers": "1"}, "layer indices from 0 to 0 \\(the target has 2 layers"),
             ({"fuse_layers": "x"}, "none, auto, or layer indices"),
             ({"init": str(tmp_path / "nope")}, "or give a head directory")]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            train(_config(chat_target, chat_data, tmp_path / "out", **overrides), stream=io.StringIO())


def test_a_checkpoint_from_before_fused_heads_resumes_unfused(trained, chat_target, chat_data, tmp_path):
    """A checkpoint whose options predate --fuse-layers fused none: resuming it under the default
    (auto) is refused by name; with --fuse-layers none it continues."""
    cfg, _ = trained
    old = tmp_path / "old"
    shutil.copytree(cfg.out, old)
    state = torch.load(old / STATE_FILE, weights_only=False)
    del state["options"]["fuse_layers"]
    state["step"] = 4
    torch.save(state, old / STATE_FILE)
    with pytest.raises(ValueError, match="--fuse-layers auto \\(checkpoint: none\\)"):
        train(_config(chat_target, chat_data, old, resume=True, fuse_layers="auto"), stream=io.StringIO())
    assert train(_config(chat_target, chat_data, old, resume=True), stream=io.StringIO())["steps"] == 5
