"""``torch.compile(model, backend="fusegraph")``: the thin registration shim.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml), so no import is needed; importing
this module also installs the capture rewrites, so the first trace already sees them.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch.fx as fx

from .capture.rewrites import install_rewrites
from .pipeline import compile_graph
from .settings import Settings


def fusegraph_backend(gm: fx.GraphModule, example_inputs: Sequence[Any],
                      options: Mapping[str, Any] | None = None, **_: Any) -> Callable:
    """Dynamo backend entry: options come from ``torch.compile(..., options={...})`` (see :class:`Settings`)."""
    settings = Settings.from_options(options)  # unknown names raise here, before any work
    return compile_graph(gm, example_inputs, settings)


fusegraph_backend._fusegraph_backend = True  # type: ignore[attr-defined]  (lets capture rewrites find us)

install_rewrites()
