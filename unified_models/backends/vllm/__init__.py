"""vLLM backend: plugin, model class, attention backend, engine helpers.

Only this package imports vLLM. Import submodules explicitly
(``unified_models.backends.vllm.engine``); importing the package itself is cheap.
"""
