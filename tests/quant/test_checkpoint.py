"""Pre-quantized bitsandbytes checkpoints (saved by transformers) load as what they store; other
quantized checkpoints are refused or warned about; GGUF / converted sources are detected."""
from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.quant import INT8, NF4

bnb = pytest.importorskip("bitsandbytes")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def save_prequantized(src, dst, method: str):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    qc = BitsAndBytesConfig(load_in_8bit=True) if method == INT8 else BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(src), quantization_config=qc, device_map="cpu")
    model.save_pretrained(str(dst))
    return model


def hf_dequantized(module) -> torch.Tensor:
    from specserve.quant.bnb import dequantize_weight
    return dequantize_weight(module).float()


@pytest.mark.parametrize("method", [INT8, NF4])
def test_prequantized_checkpoint_serves_its_stored_weights(tiny_llama_dir, tmp_path, method):
    hf = save_prequantized(tiny_llama_dir, tmp_path / "q", method)
    llm = LLM(str(tmp_path / "q"), dtype="float32", device="cpu", num_kv_blocks=16)  # no --quantization
    assert llm.engine.loaded.quantization == method
    ours = llm.engine.loaded.model.layers[1]
    theirs = hf.model.layers[1]
    expected_qkv = torch.cat([hf_dequantized(getattr(theirs.self_attn, n))
                              for n in ("q_proj", "k_proj", "v_proj")])
    torch.testing.assert_close(hf_dequantized(ours.self_attn.qkv_proj), expected_qkv, rtol=0, atol=1e-6)
    expected_down = hf_dequantized(theirs.mlp.down_proj)
    torch.testing.assert_close(hf_dequantized(ours.mlp.down_proj), expected_down, rtol=0, atol=1e-6)
    out = llm.generate([{"prompt_token_ids": [4, 5, 6]}], GREEDY)
    assert len(out[0].outputs[0].token_ids) == GREEDY.max_tokens
    other = NF4 if method == INT8 else INT8
    with pytest.raises(ValueError, match=f"pre-quantized with {method}"):
        LLM(str(tmp_path / "q"), dtype="float32", device="cpu", num_kv_blocks=16, quantization=other)
    # vLLM's `--quantization bitsandbytes`: what the checkpoint declares
    generic = LLM(str(tmp_path / "q"), dtype="float32", device="cpu", num_kv_blocks=16, quantization="bitsandbytes")
    assert generic.engine.loaded.quantization == method


def test_generic_bitsandbytes_quantizes_a_float_checkpoint_to_nf4(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=16, quantization="bitsandbytes")
    assert llm.engine.loaded.quantization == NF4


def _with_quant_config(src, dst, qc: dict):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("qc,reason", [
    ({"quant_method": "gptq", "bits": 4}, "quantized with 'gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}, "4-bit fp4"),
])
def test_unsupported_prequantized_checkpoints_are_refused(tiny_llama_dir, tmp_path, qc, reason):
    path = _with_quant_config(tiny_llama_dir, tmp_path / "m", qc)
    with pytest.raises(ValueError, match=reason):
        LLM(str(path), device="cpu", num_kv_blocks=8)


def test_incomplete_int8_tensor_is_refused():
    from specserve.quant.checkpoint import dequantize_bnb_tensors

    tensors = [("model.layers.0.mlp.down_proj.weight", torch.zeros(4, 4, dtype=torch.int8))]
    with pytest.raises(ValueError, match="down_proj.weight is incomplete"):
        list(dequantize_bnb_tensors(tensors))


# -- provenance ----------------------------------------------------------------------------------
def test_converted_q4_checkpoint_warns_on_nf4(tiny_llama_dir, tmp_path, caplog, monkeypatch):
    from specserve.quant.checkpoint import PROVENANCE_FILE, source_quantization

    marked = tmp_path / "converted"
    shutil.copytree(tiny_llama_dir, marked)
    marker = {"source_format": "gguf", "source_quantization": "Q4_K"}
    (marked / PROVENANCE_FILE).write_text(json.dumps(marker))
    assert source_quantization(marked) == "Q4_K"
    assert source_quantization(tiny_llama_dir) is None
    with caplog.at_level(logging.WARNING, logger="specserve.quant.checkpoint"):
        LLM(str(marked), device="cpu", num_kv_blocks=8, quantization=NF4)
    assert "already quantized (Q4_K)" in caplog.text
    # the default model's directory counts as Q4_1 (it is converted from SmolLM2-135M-Instruct.Q4_1.gguf)
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    from specserve.models.default_model import default_model_dir
    default_model_dir().mkdir(parents=True)
    assert source_quantization(default_model_dir()) == "Q4_1"


def test_gguf_quantization_type_is_read(tmp_path):
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    from specserve.quant.checkpoint import source_quantization

    path = tmp_path / "m.gguf"
    writer = GGUFWriter(str(path), "llama")
    weight = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor("blk.0.ffn_down.weight", quantize(weight, GGMLQuantizationType.Q8_0),
                      raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert source_quantization(path) == "Q8_0"
