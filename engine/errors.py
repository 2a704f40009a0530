"""The project's own exception hierarchy.

Every failure a user can cause (a bad file, an unsupported model, an impossible request) raises a
subclass of :class:`SharpIError` whose message says what is wrong and, where it helps, what to do.
"""

from __future__ import annotations


class SharpIError(Exception):
    """Base class of every error the engine raises on purpose."""


class GGUFError(SharpIError):
    """The file cannot be used as a GGUF model."""

    def __init__(self, message: str, path: str | None = None):
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


class NotGGUFError(GGUFError):
    """The file does not start with the GGUF magic."""


class UnsupportedVersionError(GGUFError):
    """The GGUF container version is not one we read."""


class TruncatedFileError(GGUFError):
    """The header or tensor data extends past the end of the file."""


class MetadataError(GGUFError):
    """A metadata key is missing, has the wrong type, or contradicts another."""


class UnsupportedArchitectureError(GGUFError):
    """``general.architecture`` names a model family we do not implement."""


class UnsupportedQuantTypeError(GGUFError):
    """A tensor uses a ggml type we have no kernels for."""


class MissingTensorError(GGUFError):
    """A tensor the architecture needs is absent."""


class TensorShapeError(GGUFError):
    """A tensor's shape disagrees with the hyperparameters."""


class ModelError(SharpIError):
    """The model computed NaN or infinity (damaged weights, or values past float32's range)."""


class UsageError(SharpIError):
    """A command-line or API argument is malformed or impossible."""


class PlanError(UsageError):
    """A placement request that cannot be satisfied (or is malformed)."""


class ChatTemplateError(SharpIError):
    """The model's chat template does not compile, or failed on the given conversation."""


class HostMemoryError(SharpIError):
    """A model does not fit the RAM available (or the loader's RAM budget), or the system refused memory or
    address space for it."""


class DeviceMemoryError(SharpIError):
    """A placement does not fit the device's memory (its budget, or a real out-of-memory)."""


class TraceError(SharpIError):
    """A routing trace file (``engine.routes``) cannot be used: not an ``.npz`` of the expected arrays, or
    arrays that contradict each other or its ``meta``."""
