"""A model given as a hub id (`org/name`) comes through huggingface_hub: from its cache offline, and an
id that cannot be had is a clear error naming the id and HF_HUB_OFFLINE (fresh interpreters:
huggingface_hub reads its environment at import)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

CODE = ("from specserve import LLM, SamplingParams\n"
        "try:\n"
        "    llm = LLM('{model}', dtype='float32', device='cpu', num_kv_blocks=16{extra})\n"
        "except ValueError as e:\n"
        "    print('ERROR', e)\n"
        "else:\n"
        "    out = llm.generate({{'prompt_token_ids': [4, 5, 6]}}, SamplingParams(temperature=0, max_tokens=3))\n"
        "    print('OK', llm.engine.model_name, out[0].outputs[0].token_ids)\n")


def _run(model: str, cache, extra: str = "") -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache))
    proc = subprocess.run([sys.executable, "-c", CODE.format(model=model, extra=extra)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_hub_id_loads_from_the_hub_cache(tiny_llama_dir, tmp_path):
    snapshot = tmp_path / "models--tiny-org--tiny-llama" / "snapshots" / "0123abc"
    shutil.copytree(tiny_llama_dir, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abc")
    line = _run("tiny-org/tiny-llama", tmp_path)
    assert line.startswith("OK tiny-org/tiny-llama ["), line
    # --download-dir: another cache; --revision: a ref of the repo
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "models--tiny-org--tiny-llama", other / "models--tiny-org--tiny-llama")
    (other / "models--tiny-org--tiny-llama" / "refs" / "v1").write_text("0123abc")
    line = _run("tiny-org/tiny-llama", tmp_path / "empty", extra=f", download_dir='{other}', revision='v1'")
    assert line.startswith("OK tiny-org/tiny-llama ["), line
    line = _run("tiny-org/tiny-llama", tmp_path, extra=", revision='no-such-ref'")
    assert line.startswith("ERROR") and "could not be fetched" in line, line


def test_unavailable_hub_id_names_the_id_and_offline_mode(tmp_path):
    line = _run("no-such-org/no-such-model", tmp_path)
    assert line.startswith("ERROR") and "'no-such-org/no-such-model'" in line and "HF_HUB_OFFLINE" in line, line
    line = _run("not/a/hub/id", tmp_path)
    assert line.startswith("ERROR model not found: not/a/hub/id"), line
