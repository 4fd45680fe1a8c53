"""A tensor-parallel HF model under torchrun: a clean eager fallback, not a crash (issue 11, item 8).

With HF-native tensor parallelism (``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))``)
the dynamo graph holds DTensor parameters, a device mesh and functional collectives. Lowering traced through
DTensor's dispatch, baked each rank's fake local shard into the program as a constant, and the first call failed
(``Please convert all Tensors to FakeTensors first`` in ``aten.embedding``). fusegraph now refuses such a graph
with one warning and runs it eagerly.

The 2-rank test runs this file itself as the torchrun worker (CPU, gloo, 127.0.0.1, a free port), in its own
process group that is killed at the deadline, so it can never hang.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.fx as fx

from fusegraph import FusegraphWarning
from fusegraph.capture.checks import CaptureRefused, check_not_distributed

TIMEOUT_S = 120
STEPS = 3


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _skip_without_distributed() -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    pytest.importorskip("accelerate", reason="transformers' tensor parallelism needs accelerate")


def test_two_rank_tp_model_runs_eagerly_with_one_warning(tmp_path: Path) -> None:
    _skip_without_distributed()
    from transformers import LlamaConfig, LlamaForCausalLM

    from fusegraph.models import TINY_DIMS

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**TINY_DIMS, "num_hidden_layers": 1})).save_pretrained(tmp_path / "model")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    if Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo on loopback only
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           __file__, str(tmp_path / "model"), str(tmp_path)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both workers: the group this test started
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {TIMEOUT_S} s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["sharded_weight"] == "DTensor", res
        assert res["equal"] == [True] * STEPS, res
        (msg,) = res["warnings"]
        assert "tensor-parallel (DTensor) graphs are not fused yet" in msg and "running it eagerly" in msg, msg
        assert "DTensor (Shard(dim=0) over 2 ranks)" in msg, msg


def test_dtensor_module_on_a_one_rank_mesh_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same refusal in-process and fast: torch's own tensor parallelism (colwise + rowwise linears) on a
    one-rank gloo group over an in-memory store (no connection is made)."""
    _skip_without_distributed()
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    if Path("/sys/class/net/lo").exists():
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        parallelize_module(mlp, init_device_mesh("cpu", (1,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
        x = torch.randn(2, 8)
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            out = torch.compile(mlp, backend="fusegraph", options={"executor": "eager"})(x)
            ref = mlp(x)
    finally:
        dist.destroy_process_group()
    msgs = [str(m.message) for m in caught if issubclass(m.category, FusegraphWarning)]
    assert len(msgs) == 1, msgs
    assert "tensor-parallel (DTensor) graphs are not fused yet" in msgs[0] and "0.weight is a DTensor (Shard(dim=0) " \
        "over 1 rank)" in msgs[0], msgs
    assert type(out) is torch.Tensor and torch.equal(out, ref)


def _graph_with(target, *args) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(target, (x, *args)))
    return fx.GraphModule(torch.nn.Module(), g)


def test_functional_collective_in_a_graph_is_refused() -> None:
    _skip_without_distributed()
    import torch.distributed._functional_collectives  # noqa: F401 - registers the _c10d_functional ops

    for target in (torch.ops._c10d_functional.all_reduce.default, torch.ops._c10d_functional.all_reduce):
        with pytest.raises(CaptureRefused, match=r"not fused yet .*collective _c10d_functional\.all_reduce"):
            check_not_distributed(_graph_with(target, "sum", "0"), [torch.zeros(2)])
    check_not_distributed(_graph_with(torch.ops.aten.relu.default), [torch.zeros(2)])  # ordinary ops pass


def test_wrapper_tensor_subclass_input_runs_eagerly() -> None:
    """DTensor's kind of tensor (a wrapper subclass) without torch.distributed: lowering used to bake its fake inner
    tensors into the program and return a subclass of *fake* tensors; now it refuses it."""
    from torch.testing._internal.two_tensor import TwoTensor

    torch.manual_seed(0)
    w = TwoTensor(torch.randn(4, 4), torch.randn(4, 4))

    def f(x):
        return torch.relu(x @ w) + 1

    x = torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        out = torch.compile(f, backend="fusegraph", options={"executor": "eager"})(x)
        ref = f(x)
    msgs = [str(m.message) for m in caught if issubclass(m.category, FusegraphWarning)]
    assert len(msgs) == 1 and "tensor subclass inputs are not lowered yet" in msgs[0] and "TwoTensor" in msgs[0], msgs
    assert type(out) is TwoTensor and torch.equal(out.a, ref.a) and torch.equal(out.b, ref.b)


def _worker(model_dir: str, out_dir: str) -> None:
    """One torchrun rank: load the TP model, compile its decode step with fusegraph, compare to the uncompiled
    TP model step by step. Results go to ``rank<N>.json``; any exception fails the rank (and torchrun)."""
    import torch.distributed as dist
    from transformers import LlamaForCausalLM, StaticCache
    from transformers.distributed import DistributedConfig

    model = LlamaForCausalLM.from_pretrained(model_dir, distributed_config=DistributedConfig(tp_plan="auto"),
                                             attn_implementation="eager").eval()
    rank = dist.get_rank()

    def prefilled() -> tuple[StaticCache, torch.Tensor]:
        cache = StaticCache(config=model.config, max_cache_len=32)
        torch.manual_seed(0)
        prompt = torch.randint(0, model.config.vocab_size, (1, 8))
        with torch.no_grad():
            logits = model(input_ids=prompt, cache=cache, use_cache=True).logits
        return cache, logits[:, -1].argmax(-1, keepdim=True)

    (cache_c, tok), (cache_e, _) = prefilled(), prefilled()

    def step(cache):
        return lambda t, p: model(input_ids=t, cache=cache, position_ids=p, use_cache=True).logits

    compiled = torch.compile(step(cache_c), backend="fusegraph", options={"executor": "nkisim", "cache_dir": "off"})
    eager = step(cache_e)
    equal, tc, te, pos = [], tok, tok, torch.full((1, 1), 8)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for _ in range(STEPS):
            a, b = compiled(tc, pos), eager(te, pos)
            equal.append(torch.equal(a, b) and type(a) is type(b))
            tc, te, pos = a[:, -1].argmax(-1, keepdim=True), b[:, -1].argmax(-1, keepdim=True), pos + 1
    res = {"rank": rank, "equal": equal,
           "sharded_weight": type(model.model.layers[0].self_attn.q_proj.weight).__name__,
           "warnings": [str(w.message) for w in caught if issubclass(w.category, FusegraphWarning)]}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
