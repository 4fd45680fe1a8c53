"""fusegraph's JAX frontend: ``fusegraph.jax.jit(step, options=...)`` fuses a JAX decode step like the torch
backend fuses a torch one (StableHLO -> the same program, patterns, megakernel and report). Needs the
``fusegraph[jax]`` extra; the torch path never imports this package. See docs/jax.md.
"""
from .frontend import Compiled, FusedFunction, jit

__all__ = ["Compiled", "FusedFunction", "jit"]
