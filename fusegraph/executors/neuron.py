"""Run the generated kernels on a real NeuronCore (Trainium) through the Neuron SDK's ``nki`` and torch-neuronx.

NOT VALIDATED ON HARDWARE: no Trainium and no Neuron SDK are available where fusegraph is developed and tested
(PyPI only has placeholder packages named ``nki``/``neuronx-cc``). This path is deliberately thin: the same
kernel source the interpreter runs is executed with the real ``nki`` (its ``@nki.jit`` detects torch tensors
on the XLA device and runs the kernel as a custom op); weights are moved to the device once per version. It is
registered only when both ``nki`` and ``torch_neuronx`` import.
"""
from __future__ import annotations

import importlib.util
from typing import Any, Callable, Mapping

import torch

from ..settings import Settings
from .kernels import KernelPlan
from .nki import NkiExecutor


def neuron_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("nki", "torch_neuronx", "torch_xla"))


class _DeviceKernel:
    def __init__(self, plan: KernelPlan) -> None:
        import torch_xla.core.xla_model as xm  # type: ignore[import-not-found]

        self.device = xm.xla_device()
        ns: dict[str, Any] = {"__name__": f"fusegraph_kernel_{plan.generated.name}"}
        exec(compile(plan.generated.source, f"<fusegraph:{plan.generated.name}>", "exec"), ns)  # real nki import
        self.fn = ns[plan.generated.name]
        self.kernel = plan.generated
        self._device_args: dict[str, tuple[int, torch.Tensor]] = {}

    def __call__(self, tensors: Mapping[str, torch.Tensor]) -> list:
        args = []
        for name in self.kernel.args:
            t = tensors[name] if name in tensors else self.kernel.constants[name]
            if name in self.kernel.specs and self.kernel.specs[name].kind in ("weight",) or name not in tensors:
                cached = self._device_args.get(name)
                if cached is None or cached[0] != id(t):
                    self._device_args[name] = (id(t), t.to(self.device))
                args.append(self._device_args[name][1])
            else:
                args.append(t.to(self.device))
        outs = self.fn(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        state = [v.name for v in self.kernel.program.outputs if v.kind == "state"]
        host = [o.cpu() for o in outs]
        for name, val in zip([v.name for v in self.kernel.program.outputs], host):
            if name in state and name in tensors:
                tensors[name].copy_(val)  # the cache lives on the host in this thin path
        return host


class NeuronExecutor(NkiExecutor):
    name = "neuron"

    def make_runner(self, plan: KernelPlan, settings: Settings) -> Callable[..., list]:
        return _DeviceKernel(plan)


def register() -> None:
    if not neuron_available():
        return
    from .base import register_executor

    @register_executor("neuron")
    def _make() -> NeuronExecutor:
        return NeuronExecutor()
