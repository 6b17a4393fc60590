"""EAGLE heads that fuse several of the target's layers (EAGLE-3's feature fusion, method eagle3):
the target's forward returns its layers' outputs as HF computes them; with such a head greedy output
is the target's (fp32: prefix hits, chunked prefill, preemption, drafting on the device or not, steps launched ahead);
heads whose layers the target does not have are refused."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from specserve import LLM
from specserve.spec_decode.eagle_head import default_aux_layers, load_head, target_weights
from tests.spec_decode.test_eagle import (LONG, _hidden, _random_head, _run_on_device, _target,
                                          assert_same_drafts_before_the_end, eagle_config, long_reference)
from tests.spec_decode.test_greedy_identity import reference

IDS = [5, 17, 33, 8, 91, 240, 12, 7, 64, 100, 3, 55, 19, 250]


def test_the_target_returns_its_layers_outputs_as_hf_does(tiny_llama_dir):
    """With aux layers the forward's rows are [final hidden, layer outputs...]: the final part and
    the logits are unchanged, each layer's output is HF's hidden state after that layer."""
    from transformers import AutoModelForCausalLM

    target = _target(tiny_llama_dir)
    h = target.arch.hidden_size
    plain = _hidden(target, IDS)
    target.model.aux_layers = (0,)
    wide = _hidden(target, IDS)
    assert wide.shape == (len(IDS), 2 * h)
    torch.testing.assert_close(wide[:, :h], plain)
    torch.testing.assert_close(target.model.compute_logits(wide), target.model.compute_logits(plain))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), torch_dtype=torch.float32)
    with torch.no_grad():
        states = hf(torch.tensor([IDS]), output_hidden_states=True).hidden_states  # [embeddings, layer 0, ...]
    torch.testing.assert_close(wide[:, h:], states[1][0], atol=1e-4, rtol=1e-4)


def test_a_fused_head_reads_the_layers_and_starts_as_the_plain_head(tiny_llama_dir):
    target = _target(tiny_llama_dir)
    target.model.aux_layers = (0,)
    head = _random_head(target, aux_layers=(0,))
    wide = _hidden(target, IDS)
    moved = wide.clone()
    moved[:, target.arch.hidden_size:] *= -3.0
    assert not torch.allclose(head.features(wide), head.features(moved)), "the aux layer is not read"
    head.init_fuse_identity()  # fuse passes the final hidden state through: the plain head's input
    torch.testing.assert_close(head.features(moved), wide[:, :target.arch.hidden_size])
    assert default_aux_layers(30) == (2, 15) and default_aux_layers(2) == (0,)


def test_served_the_target_computes_the_fused_feature_itself(tiny_llama_dir, fused_head_dir):
    """When serving, the target's forward returns [final hidden, the head's feature] (computed inside
    the forward, so inside its CUDA graphs: a step costs no host work for it), the feature equal to
    what the head computes from the layers' outputs; what the engine stores per KV slot is that feature."""
    from specserve.spec_decode import fuse_target_layers

    target = _target(tiny_llama_dir)
    h = target.arch.hidden_size
    head = _random_head(target, aux_layers=(0,))
    fuse_target_layers(target, head.aux_layers)
    rows = _hidden(target, IDS)
    fuse_target_layers(target, head.aux_layers, head.fuse_layers)
    served = _hidden(target, IDS)
    assert served.shape == (len(IDS), 2 * h)
    torch.testing.assert_close(served[:, :h], rows[:, :h])
    with torch.no_grad():
        torch.testing.assert_close(served[:, h:], head.features(rows))
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_num_seqs=2,
              speculative_config=dict(eagle_config(fused_head_dir, 3), method="eagle3"))
    model = llm.engine.runner.target.model
    assert model.aux_layers and model.aux_features is not None


@pytest.mark.parametrize("args", ["mixed", "preempt"])
def test_greedy_identity_with_a_fused_head(tiny_llama_dir, fused_head_dir, args):
    """method eagle3, k = 3: the target's output, on the host path and drafting on the device with the
    same drafts and acceptance, with drafts accepted and rejected."""
    spec = dict(eagle_config(fused_head_dir, 3), method="eagle3")
    host = _run_on_device(tiny_llama_dir, args, spec, False)
    device = _run_on_device(tiny_llama_dir, args, spec, True)
    assert device[0] == host[0] == reference(tiny_llama_dir, args)
    assert device[1] == host[1] and 0 < host[1][2] < host[1][1]
    # method eagle loads a fused head too
    plain = _run_on_device(tiny_llama_dir, args, eagle_config(fused_head_dir, 3), False)
    assert plain[:2] == host[:2]


def test_a_fused_head_with_steps_launched_ahead(tiny_llama_dir, fused_head_dir):
    """Async drafting with a fused head (its feature stored at the moved-back KV slots): the target's
    output, with the drafts and acceptance of drafting on the device without it (up to each request's
    last steps)."""
    spec = dict(eagle_config(fused_head_dir, 3), method="eagle3")
    plain = _run_on_device(tiny_llama_dir, "mixed", spec, True, params=LONG, async_scheduling=True)
    ahead = _run_on_device(tiny_llama_dir, "mixed", spec, True, params=LONG, async_scheduling=True,
                           async_drafting=True)
    assert ahead[3] > 20 and ahead[0] == plain[0] == long_reference(tiny_llama_dir, "mixed")
    assert_same_drafts_before_the_end(ahead, plain, 3)


def test_fused_heads_that_do_not_fit_are_refused(tiny_llama_dir, fused_head_dir, tmp_path):
    """(method eagle3 with a head that fuses no layers: test_eagle.py)"""
    for aux, message in [([7], "fuses target layers \\[7\\], but the target has 2"),
                         ([1, 0], "distinct, ascending"), ("2", "list of layer indices")]:
        bad = tmp_path / f"bad{len(str(aux))}"
        shutil.copytree(fused_head_dir, bad)
        config = json.loads((bad / "config.json").read_text())
        config["aux_layers"] = aux
        (bad / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            LLM(str(tiny_llama_dir), dtype="float32", device="cpu", speculative_config=eagle_config(bad, 3))
    head = load_head(fused_head_dir, dtype=torch.float32, device=torch.device("cpu"), max_positions=64)
    head.attach(*target_weights(_target(tiny_llama_dir), torch.device("cpu"), torch.float32))
    assert head.aux_layers == (0,)
