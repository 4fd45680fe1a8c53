"""No kernel test cases: the step's cache positions are host-side (``register_lowering(..., host_side=True)``),
computed on the eager path (with the cache counter's in-place advance) and read by the kernel's KV writes as a
per-step input; no instruction of this op runs in a kernel."""
from fusegraph.codegen.api import register_cases

register_cases(__package__, why_none="host-side: the cache positions (and the counter's advance) are computed "
                                     "eagerly and passed to the kernel as a per-step input; no instruction of this op "
                                     "runs in a kernel")
