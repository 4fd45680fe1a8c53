"""No kernel test cases: the causal mask is host-side (``register_lowering(..., host_side=True)``), computed on the
eager path and read by the kernel's attention as a per-step input; no instruction of this op runs in a kernel."""
from fusegraph.codegen.api import register_cases

register_cases(__package__, why_none="host-side: the mask is computed eagerly and passed to the kernel as a "
                                     "per-step input; no instruction of this op runs in a kernel")
