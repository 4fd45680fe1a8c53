"""Scripted model answers for the writer tests: one correct kernel and each known way of getting it wrong."""
from __future__ import annotations

import torch

from fusegraph.llm.task import KernelTask, TensorSpec

REFERENCE = '''def reference(x, b):
    return 2.0 * x + b
'''


def scaled_add_task(rows: int = 4, cols: int = 64, name: str = "scaled_add") -> KernelTask:
    return KernelTask(
        name=name, reference_source=REFERENCE, reference=lambda x, b: 2.0 * x + b,
        inputs=[TensorSpec("x", (rows, cols), torch.float32), TensorSpec("b", (rows, cols), torch.float32)],
        outputs=[TensorSpec("out", (rows, cols), torch.float32)], model="test-model", context="y = 2x + b")


HEADER = '''import nki
import nki.language as nl
import nki.isa as nisa
'''

GOOD = HEADER + '''

@nki.jit
def scaled_add(x, b):
    out = nl.ndarray(shape=(4, 64), dtype=nl.float32, buffer=nl.shared_hbm, name="out")
    xs = nl.ndarray(shape=(4, 64), dtype=nl.float32, buffer=nl.sbuf, name="xs")
    bs = nl.ndarray(shape=(4, 64), dtype=nl.float32, buffer=nl.sbuf, name="bs")
    nisa.dma_copy(dst=xs, src=x)
    nisa.dma_copy(dst=bs, src=b)
    ys = nl.ndarray(shape=(4, 64), dtype=nl.float32, buffer=nl.sbuf, name="ys")
    nisa.scalar_tensor_tensor(dst=ys, data=xs, op0=nl.multiply, operand0=2.0, op1=nl.add, operand1=bs)
    nisa.dma_copy(dst=out, src=ys)
    return out
'''


def answer(code: str, prose: str = "Here is the kernel:") -> str:
    return f"{prose}\n\n```python\n{code}```\n"


INVENTED_API = GOOD.replace(
    "nisa.scalar_tensor_tensor(dst=ys, data=xs, op0=nl.multiply, operand0=2.0, op1=nl.add, operand1=bs)",
    "nisa.fused_scale_add(dst=ys, data=xs, scale=2.0, addend=bs)")

TORCH_FALLBACK = '''import torch
import nki
import nki.language as nl


@nki.jit
def scaled_add(x, b):
    return torch.as_tensor(x) * 2 + torch.as_tensor(b)
'''

NUMPY_FALLBACK = GOOD.replace("import nki\n", "import numpy as np\nimport nki\n", 1)

RETURNS_INPUT = HEADER + '''

@nki.jit
def scaled_add(x, b):
    return x
'''

COPY_ONLY = HEADER + '''

@nki.jit
def scaled_add(x, b):
    out = nl.ndarray(shape=(4, 64), dtype=nl.float32, buffer=nl.shared_hbm, name="out")
    xs = nl.ndarray(shape=(4, 64), dtype=nl.float32, buffer=nl.sbuf, name="xs")
    nisa.dma_copy(dst=xs, src=x)
    nisa.dma_copy(dst=out, src=xs)
    return out
'''

DEAD_COMPUTE = COPY_ONLY.replace(
    "    nisa.dma_copy(dst=out, src=xs)\n",
    "    if x.shape[0] > 1000:\n"
    "        nisa.tensor_tensor(dst=xs, data1=xs, data2=xs, op=nl.add)\n"
    "    nisa.dma_copy(dst=out, src=xs)\n")

IMPORTS_OS = GOOD.replace("import nki\n", "import os\nimport nki\n", 1).replace(
    "    return out\n", "    os.system('touch /tmp/pwned')\n    return out\n")

OPENS_FILE = GOOD.replace("    return out\n", "    secret = open('/etc/passwd').read()\n    return out\n")

WRONG = GOOD.replace("operand0=2.0", "operand0=2.5")

NEVER_ENDS = GOOD.replace("    return out\n", "    while True:\n        pass\n    return out\n")

GARBAGE = "I am sorry, I cannot help with NKI kernels today. Perhaps try a different approach?"
