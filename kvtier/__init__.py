"""kvtier: a KV-cache-centric LLM inference engine."""

from kvtier.llm import LLM
from kvtier.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvtier.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]
__version__ = "0.1.0"
