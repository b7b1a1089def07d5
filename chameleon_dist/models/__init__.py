"""Model shapes and the model definitions built from them.

``shape``: ``TransformerShape``, the one shape type (imports nothing of this package). ``llama``: a plain
PyTorch Llama-style decoder recorded on the ``meta`` device for ``chameleon-trace --model llama2-7b``
(imports torch and the profiler; import it by name). The Megatron-core GPT builder lives in
``integrations/megatron/gpt.py``, the only place that imports Megatron.
"""

from chameleon_dist.models.shape import TransformerShape

__all__ = ["TransformerShape"]
