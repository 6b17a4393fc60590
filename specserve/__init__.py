"""specserve: LLM inference engine and server."""
from specserve.engine.outputs import CompletionOutput, RequestOutput
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
