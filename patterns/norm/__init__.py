"""RMSNorm (HF Llama/Qwen/Mistral and q/k-norms), RMSNorm with a (1 + weight) offset (Gemma) and LayerNorm
(with a weight + 1 offset: Nemotron): one
normalization instruction over the features of each token, in fp32.

One folder, one op: its pattern(s), instruction, lowering, templates and torch reference (docs/patterns.md).
"""
from pathlib import Path

from fusegraph.codegen.api import add_template_dir

add_template_dir(Path(__file__).parent / "templates")

from . import rmsnorm, rmsnorm_offset, layernorm, layernorm_offset, lowering  # noqa: E402,F401  (registration)
