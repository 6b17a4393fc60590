"""Quantize-on-load with bitsandbytes int8 / nf4 on tiny random models: end to end, smaller storage
(counted with scales), layers close to float, opt-in quantized embeddings, quiet int8 in bf16."""
from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from torch import nn

from specserve import LLM, SamplingParams
from specserve.models.layers.cpu_linear import PackedLinear
from specserve.quant import INT8, NF4

bnb = pytest.importorskip("bitsandbytes")
METHODS = [INT8, NF4]
PROMPTS = [{"prompt_token_ids": [5, 17, 33, 2, 90]}, {"prompt_token_ids": list(range(3, 40))}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def projections(model: nn.Module) -> list[nn.Module]:
    return [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                  layer.mlp.gate_up_proj, layer.mlp.down_proj)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", METHODS)
def test_quantized_model_generates(tiny_model_dir, method, dtype):
    llm = LLM(str(tiny_model_dir), dtype=dtype, device="cpu", quantization=method, num_kv_blocks=32)
    model = llm.engine.loaded.model
    layer_type = bnb.nn.Linear8bitLt if method == INT8 else bnb.nn.Linear4bit
    assert all(isinstance(m, layer_type) for m in projections(model))
    assert type(model.embed_tokens) is nn.Embedding  # embeddings / lm_head stay unless asked
    # unquantized (on the CPU a float head runs packed for oneDNN: models/layers/cpu_linear.py)
    assert model.lm_head is None or type(model.lm_head) in (nn.Linear, PackedLinear)
    assert llm.engine.loaded.quantization == method
    outs = llm.generate(PROMPTS, GREEDY)
    vocab = llm.engine.loaded.arch.vocab_size
    for out in outs:
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
        assert all(0 <= t < vocab for t in out.outputs[0].token_ids)
    assert llm.engine.kv_manager.pool.num_used_blocks == 0


def test_quantized_storage_is_smaller_and_counted_with_scales(tiny_llama_dir):
    """weight_bytes counts int8 codes + row scales, packed nf4 + block absmax; bf16 = 2 bytes/weight."""
    sizes = {}
    for method in (None, INT8, NF4):
        llm = LLM(str(tiny_llama_dir), dtype="bfloat16", device="cpu", quantization=method, num_kv_blocks=8)
        sizes[method] = llm.engine.weight_memory
        if method == INT8:
            # exact: one int8 per weight + one fp32 absmax per output row
            expect = sum(m.in_features * m.out_features + 4 * m.out_features
                         for m in projections(llm.engine.loaded.model))
            assert sizes[method].quantized == expect
    linear_bf16 = sizes[None].total - sizes[INT8].unquantized
    assert sizes[NF4].unquantized == sizes[INT8].unquantized == sizes[None].total - linear_bf16
    assert sizes[INT8].quantized < 0.55 * linear_bf16
    # 4 bits + 1/64 byte of absmax per weight, plus bnb's per-layer code tables (1.1 KiB, tiny here)
    num_weights = linear_bf16 // 2
    assert num_weights / 2 < sizes[NF4].quantized < num_weights / 2 + num_weights / 32 + 8 * 1200


@pytest.mark.parametrize("method,max_rel_err", [(INT8, 0.03), (NF4, 0.15)])
def test_quantized_layer_stays_close_to_float(method, max_rel_err):
    from specserve.quant.bnb import quantize_linear

    torch.manual_seed(0)
    linear = nn.Linear(576, 1536, bias=False)
    nn.init.normal_(linear.weight, std=0.02)
    q = quantize_linear(linear, method, torch.device("cpu"), torch.float32)
    x = torch.randn(8, 576)
    with torch.inference_mode():
        ref, got = linear(x), q(x)
    assert (got - ref).norm() / ref.norm() < max_rel_err
    bf16_bytes = 2 * linear.weight.numel()
    from specserve.quant import weight_bytes
    assert weight_bytes(q) < (0.27 if method == NF4 else 0.51) * bf16_bytes


def test_int8_in_bf16_does_not_spam_warnings(tiny_llama_dir, caplog):
    llm = LLM(str(tiny_llama_dir), dtype="bfloat16", device="cpu", quantization=INT8, num_kv_blocks=16)
    with caplog.at_level(logging.WARNING):
        llm.generate(PROMPTS, GREEDY)
    assert not [r for r in caplog.records if "MatMul8bitLt" in r.getMessage()]


@pytest.mark.parametrize("method", METHODS)
def test_quantized_embeddings_and_lm_head(tiny_model_dir, method):
    from specserve.quant.vocab import QuantizedEmbedding, QuantizedLMHead

    plain = LLM(str(tiny_model_dir), dtype="float32", device="cpu", quantization=method, num_kv_blocks=16)
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", quantization=method, num_kv_blocks=16,
              quantize_embeddings=True)
    model = llm.engine.loaded.model
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and isinstance(model.lm_head, QuantizedLMHead)
    if llm.engine.loaded.arch.tie_word_embeddings:  # one quantized copy serves both
        assert model.lm_head.vocab is model.embed_tokens.vocab
    assert llm.engine.weight_bytes < 0.7 * plain.engine.weight_bytes
    ids = torch.tensor([0, 7, 300 - 1])
    float_rows = plain.engine.loaded.model.embed_tokens(ids)
    got = model.embed_tokens(ids)
    assert (got - float_rows).norm() / float_rows.norm() < (0.02 if method == INT8 else 0.15)
    outs = llm.generate(PROMPTS, GREEDY)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)


def test_dummy_weights_quantize(tiny_qwen2_dir):
    """--load-format dummy (random weights of a shape) quantizes too: the benchmarks' GPU path."""
    llm = LLM(str(tiny_qwen2_dir / "config.json"), load_format="dummy", dtype="bfloat16", device="cpu",
              quantization=NF4, num_kv_blocks=16)
    assert isinstance(llm.engine.loaded.model.layers[0].self_attn.qkv_proj, bnb.nn.Linear4bit)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY)
    assert len(out[0].outputs[0].token_ids) == GREEDY.max_tokens


# -- refusals ------------------------------------------------------------------------------------
def test_unsupported_combinations_are_refused(monkeypatch):
    from specserve.config import ModelConfig
    from specserve.quant import check_supported
    from specserve.quant.vocab import QuantizedVocab

    with pytest.raises(ValueError, match="quantize_embeddings needs --quantization"):
        ModelConfig(quantize_embeddings=True)
    with pytest.raises(ValueError, match="not one of"):
        check_supported("bitsandbytes-fp4", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="runs on cpu and cuda"):
        check_supported(NF4, torch.device("meta"), torch.float32)
    with pytest.raises(ValueError, match="divisible by 64"):
        QuantizedVocab(torch.randn(10, 48), NF4, torch.float32)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    with pytest.raises(ValueError, match="compute capability 7.5"):
        check_supported(INT8, torch.device("cuda"), torch.float16)
    check_supported(NF4, torch.device("cuda"), torch.float16)  # nf4 runs on older GPUs


def test_an_unquantized_engine_does_not_import_bitsandbytes(tiny_llama_dir):
    """A real process builds and runs an unquantized engine: bitsandbytes stays unimported (importing it
    printed a model-hub warning at every start-up on AVX512-BF16 CPUs); a quantized one imports it."""
    code = ("import sys\nfrom specserve import LLM, SamplingParams\n"
            f"llm = LLM({str(tiny_llama_dir)!r}, device='cpu', dtype='float32'EXTRA)\n"
            "llm.generate([{'prompt_token_ids': [5, 6, 7]}], SamplingParams(max_tokens=2))\n"
            "print('bitsandbytes' in sys.modules)")
    for extra, imported in (("", "False"), (", quantization='bitsandbytes-int8'", "True")):
        out = subprocess.run([sys.executable, "-c", code.replace("EXTRA", extra)], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == imported, (extra, out.stdout)


def test_missing_bitsandbytes_says_how_to_install(monkeypatch, tiny_llama_dir):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(ValueError, match=r"pip install 'specserve\[quant\]'"):
        LLM(str(tiny_llama_dir), device="cpu", quantization=NF4, num_kv_blocks=8)


# -- GPU (run on the accelerator machine) --------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_freed_gpu_memory_goes_to_kv_blocks():
    import gc

    blocks = {}
    for method in (None, NF4):
        llm = LLM("qwen2.5-0.5b", load_format="dummy", device="cuda", dtype="bfloat16", quantization=method,
                  max_model_len=2048, gpu_memory_utilization=0.5)
        blocks[method] = llm.engine.kv_manager.pool.num_blocks
        out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], GREEDY)
        assert len(out[0].outputs[0].token_ids) == GREEDY.max_tokens
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert blocks[NF4] > blocks[None]
