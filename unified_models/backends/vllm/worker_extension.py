"""What a vLLM worker answers for unified_models when its engine runs in another process.

``unified-models serve`` starts vLLM's server with ``--worker-extension-cls`` naming
:class:`UnifiedWorkerExtension`; vLLM mixes it into its worker class
(``v1/worker/worker_base.py``, ``WorkerWrapperBase.init_worker``), so the API process reaches
it through ``engine_client.collective_rpc("unified_models_fingerprint")``.
"""

from __future__ import annotations

__all__ = ["UnifiedWorkerExtension", "QUALNAME"]

QUALNAME = "unified_models.backends.vllm.worker_extension.UnifiedWorkerExtension"
"""The ``--worker-extension-cls`` value."""


class UnifiedWorkerExtension:
    """Methods vLLM adds to its worker (``self`` is the worker: ``model_runner``, ``vllm_config``)."""

    def unified_models_fingerprint(self) -> dict:
        """This engine's execution-contract fingerprint as JSON: the fields of
        ``Fingerprint.as_dict()`` (engine, digests, short values) and ``component_values`` (every
        component's canonical value, enough to rebuild the ``Fingerprint``).

        Raises:
            RuntimeError: the worker does not run unified_models' model class.
        """
        from . import compat
        from .fingerprint import model_fingerprint
        from .live import config_settings, runner_model_class
        from .model import UnifiedForCausalLM

        runner = self.model_runner
        model = compat.unwrap_model(runner.get_model())
        if not isinstance(model, UnifiedForCausalLM):
            raise RuntimeError(f"the engine runs {type(model).__name__}, not unified_models' UnifiedForCausalLM")
        fp = model_fingerprint(model, config_settings(self.vllm_config, lambda: runner_model_class(runner)))
        return {**fp.as_dict(), "component_values": dict(fp.components)}
