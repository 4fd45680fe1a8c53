"""Launch :mod:`tp_worker` under torchrun for the tensor-parallel tests: CPU, gloo, loopback only, bounded in time.

``torchrun`` runs in a new session (its own process group); at the deadline the whole group (torchrun and every
rank) is killed, so a rank stuck in a collective can never hang the test suite.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

WORKER = Path(__file__).with_name("tp_worker.py")
REPO = Path(__file__).resolve().parents[2]


def skip_without_distributed() -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    pytest.importorskip("accelerate", reason="transformers' tensor parallelism needs accelerate")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_env() -> dict[str, str]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    if Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo on loopback only
    return env


def run_ranks(cases: list[dict[str, Any]], out_dir: Path, nproc: int = 2,
              timeout_s: int = 240) -> dict[str, list[dict[str, Any]]]:
    """Run the worker's ``cases`` (each a dict with a unique ``name``) in one launch of ``nproc`` ranks; return
    {case name: each rank's result}. Fails the test on any rank's error or at the deadline."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = {"cases": cases, "out": str(out_dir)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(WORKER), json.dumps(spec)]
    proc = subprocess.Popen(cmd, env=loopback_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: the session this test started
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {timeout_s} s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-8000:]
    return {c["name"]: [json.loads((out_dir / f"{c['name']}.rank{r}.json").read_text()) for r in range(nproc)]
            for c in cases}


def save_tiny(family: str, path: Path, dtype: str = "float32", **config: Any) -> Any:
    """A tiny random ``<family>ForCausalLM`` (fusegraph's TINY_DIMS + ``config``) saved to ``path``; returns it."""
    import transformers

    from fusegraph.models import TINY_DIMS

    from fusegraph.models import _spread_router_weights

    cls = getattr(transformers, family + "ForCausalLM")
    torch.manual_seed(0)
    model = cls(cls.config_class(**{**TINY_DIMS, **config})).eval()
    _spread_router_weights(model)  # tiny random routers tie otherwise (ill-conditioned top-k)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    return model


def single_process_reference(model: Any, steps: int, batch: int = 1, **kw: Any) -> dict[str, list]:
    """Greedy decode of the unsharded model, with the workers' prompt: tokens and last-position logits per step."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=32)
    torch.manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (batch, 8))
    out: dict[str, list] = {"tokens": [], "logits": []}
    with torch.no_grad():
        logits = model(input_ids=prompt, cache=cache, use_cache=True).logits
        tok = logits[:, -1].argmax(-1, keepdim=True)
        pos = torch.full((batch, 1), 8)
        for _ in range(steps):
            logits = model(input_ids=tok, cache=cache, position_ids=pos, use_cache=True).logits
            out["logits"].append(logits[:, -1].float().reshape(-1).tolist())
            tok, pos = logits[:, -1].argmax(-1, keepdim=True), pos + 1
            out["tokens"].append(tok.reshape(-1).tolist())
    return out
