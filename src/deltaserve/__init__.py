"""DeltaServe: LoRA fine-tuning folded into the idle capacity of an LLM inference engine.

Layers (arrows point down): ``hosts`` -> ``train``/``model`` -> ``core``. ``deltaserve.core`` is the
host-agnostic control plane and imports neither torch nor any inference engine.
"""

__version__ = "0.1.0"
