"""Triton kernels of specserve and their plain-PyTorch references (import name `specserve.kernels`)."""
import sys

if __name__ == "kernels":
    # Imported as top-level `kernels`: the checkout's root is on sys.path (pytest, `python -m` run from
    # it) and this folder shadows the PyPI package of that name, which recent transformers depend on
    # and import (transformers 5.25: even a LlamaConfig does). Load that package in our place; where
    # none is installed, stay an empty module (transformers 5.17 imports the name to look for a
    # version, and takes none as "not available").
    import importlib.machinery
    import importlib.util
    import os

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # what `import kernels` returns
        _spec.loader.exec_module(_module)
else:
    from specserve.kernels.activation import ref_silu_and_mul, silu_and_mul
    from specserve.kernels.attention_config import KernelConfig, select_configs
    from specserve.kernels.chain_positions import chain_positions, ref_chain_positions
    from specserve.kernels.greedy_pick import greedy_pick, linear_greedy_pick, ref_greedy_pick, ref_linear_greedy_pick
    from specserve.kernels.head_input import head_input, ref_head_input
    from specserve.kernels.int8_linear import int8_linear, ref_int8_linear
    from specserve.kernels.move_back import move_back, ref_move_back, warm_up_move_back
    from specserve.kernels.paged_attention import paged_attention, ref_paged_attention, warm_up_paged_attention
    from specserve.kernels.reshape_and_cache import ref_reshape_and_cache, reshape_and_cache
    from specserve.kernels.rms_norm import ref_rms_norm, rms_norm
    from specserve.kernels.rotary import ref_rotary_embedding, rotary_embedding

    __all__ = [
        "KernelConfig",
        "chain_positions",
        "greedy_pick",
        "head_input",
        "int8_linear",
        "linear_greedy_pick",
        "move_back",
        "paged_attention",
        "ref_chain_positions",
        "ref_greedy_pick",
        "ref_head_input",
        "ref_int8_linear",
        "ref_linear_greedy_pick",
        "ref_move_back",
        "ref_paged_attention",
        "ref_reshape_and_cache",
        "ref_rms_norm",
        "ref_rotary_embedding",
        "ref_silu_and_mul",
        "reshape_and_cache",
        "rms_norm",
        "rotary_embedding",
        "select_configs",
        "silu_and_mul",
        "warm_up_move_back",
        "warm_up_paged_attention",
    ]
