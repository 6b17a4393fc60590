"""specserve: LLM inference engine and server.

The public names load on first use (PEP 562), so that `import specserve.<part>` (the cache, the
scheduler, the config, the client, the CLI) does not pull in torch through `LLM`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from specserve.utils import lazy_attributes

if TYPE_CHECKING:
    from specserve.engine.outputs import CompletionOutput, RequestOutput
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]

__getattr__ = lazy_attributes(__name__, {
    "LLM": "specserve.llm",
    "SamplingParams": "specserve.sampling_params",
    "RequestOutput": "specserve.engine.outputs",
    "CompletionOutput": "specserve.engine.outputs",
})
