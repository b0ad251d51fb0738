"""Model plugins: hooks, discovery and the registry (``registry``), the generic tiny-checkpoint
writer plugins build on (``tiny_checkpoints``) and the embedded demos (``demo``).

What a plugin's hooks module imports is exported here, so that import keeps working across versions and
a plugin written for another API version gets the registry's clear refusal instead of an ImportError.
"""

from pegainfer.plugins.registry import PLUGIN_API_VERSION, ModelRegistration, TinyCheckpointBuilder, hookimpl

__all__ = ["PLUGIN_API_VERSION", "ModelRegistration", "TinyCheckpointBuilder", "hookimpl"]
