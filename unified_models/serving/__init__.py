"""Serving: ``unified-models serve`` (vLLM's OpenAI-compatible server with our model class and pins,
:mod:`.serve`) and tokenizers that cover a model's vocabulary (:mod:`.vocabulary`)."""
