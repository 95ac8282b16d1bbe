"""Errors raised for bad user input. Each names what is wrong."""


class UnifiedModelsError(Exception):
    """Base class: every error we raise for bad input derives from it."""


class SpecError(UnifiedModelsError, ValueError):
    """A model spec or the config it was built from is invalid."""


class UnsupportedLayerError(SpecError):
    """A config asks for a layer type this version does not implement."""


class ParallelismError(UnifiedModelsError, ValueError):
    """A parallel layout we refuse (e.g. tensor parallel > 1)."""


class CheckpointError(UnifiedModelsError, ValueError):
    """A checkpoint is missing, corrupt, or does not match the spec."""


class PromptError(UnifiedModelsError, ValueError):
    """A prompt file is missing, empty or malformed."""
