"""The layer-wise engine shared by pruning, LaCo compensation and fidelity.

Only the decoder layer being worked on (and its dense twin) lives on the device; the models
stay on CPU and activations live in an ActivationCache on CPU or memory-mapped on disk.
"""

from laco_deploy.engine.cache import ActivationCache
from laco_deploy.engine.capture import EmbeddedOnDemand, LayerInputs, capture_layer_inputs
from laco_deploy.engine.checkpoint import LayerCheckpoints
from laco_deploy.engine.lazy import LazyModel, capture_inputs
from laco_deploy.engine.walk import Lane, LayerContext, LayerLoader, Paths, WalkOptions, walk_layers, walk_side_by_side

__all__ = [
    "ActivationCache",
    "EmbeddedOnDemand",
    "Lane",
    "LayerCheckpoints",
    "LayerContext",
    "LayerInputs",
    "LayerLoader",
    "LazyModel",
    "Paths",
    "WalkOptions",
    "capture_inputs",
    "capture_layer_inputs",
    "walk_layers",
    "walk_side_by_side",
]
