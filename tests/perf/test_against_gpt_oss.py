"""The hand-written GPT-OSS-20B megakernel (KevGomes1403/nki-moe-megakernel, ``megakernels/gpt_oss``) runs unmodified
in the interpreter, shape-only, as one rank of its TP=8 x LNC=1 deployment (fusegraph.perf.against_specs_gpt_oss).

Needs checkouts: ``MK_GPTOSS`` (or ``MK``) holding the kernel -- commit 9a3c4b5 is the tree the published exp-7 profile ran --
and ``NKILIB`` holding nki-library's ``nkilib``; skipped without them. Two layers run in a few seconds."""
import os

import pytest

SPEC = "fusegraph.perf.against_specs_gpt_oss:gpt_oss_megakernel"
KERNEL = "megakernels/gpt_oss/transformer_gpt_oss.py"
US = 1e6
#: weight bytes one rank reads per layer: fused QKV [3072, 640] + O [512, 3072] + router [3072, 32] + 4 of the 32
#: experts' gate/up [3072, 2, 384] and down [384, 3072], bf16 (biases, norms and KV caches are < 0.3 MB more)
WEIGHT_BYTES_PER_LAYER = 2 * (3072 * 640 + 512 * 3072 + 3072 * 32 + 4 * (3072 * 2 * 384 + 384 * 3072))


def _checkout() -> str | None:
    """The checkout the spec reads: MK_GPTOSS when set, else MK."""
    path = os.environ.get("MK_GPTOSS") or os.environ.get("MK")
    return path if path and os.path.exists(os.path.join(path, KERNEL)) else None


def test_spec_says_which_checkout_is_missing(monkeypatch):
    from fusegraph.perf.against_specs_gpt_oss import gpt_oss_megakernel

    monkeypatch.delenv("MK_GPTOSS", raising=False)
    monkeypatch.delenv("MK", raising=False)
    with pytest.raises(RuntimeError, match="MK_GPTOSS"):
        gpt_oss_megakernel(layers=1)


@pytest.fixture(scope="module")
def two_layers():
    if _checkout() is None or not os.path.isdir(os.path.join(os.environ.get("NKILIB", ""), "nkilib")):
        pytest.skip("set MK_GPTOSS (or MK) to a nki-moe-megakernel checkout with megakernels/gpt_oss, and NKILIB")
    from fusegraph.perf.against import load_spec, run_spec
    from fusegraph.perf.costmodel import estimate_kernel
    from fusegraph.perf.kernelview import view_from_trace
    from fusegraph.perf.params import load_params

    spec = load_spec(SPEC, layers=2)
    prof = run_spec(spec)
    est = estimate_kernel(view_from_trace(prof.trace[(0, 0)], filename=spec.name), load_params("trn3"))
    return spec, prof, est


def test_kernel_runs_from_the_checkout_with_layers_attributed(two_layers):
    spec, prof, est = two_layers
    assert spec.shard == (8, 1) and spec.lnc == 1 and spec.layers == 2
    body = spec.kernel.func.__globals__["_multilayer_body"].__code__.co_filename
    assert os.path.realpath(body) == os.path.realpath(os.path.join(_checkout(), KERNEL))
    events = prof.trace[(0, 0)]
    assert len(events) > 2000  # ~1,400 instructions per layer, most of them the experts' matmuls
    assert sorted(k for k in est.layers if isinstance(k, int)) == [0, 1]
    assert sum(1 for e in events if e.layer is None) < 50  # only the residual load/store and masks outside layers
    files = {os.path.basename(e.file) for e in events}
    assert {"transformer_gpt_oss.py", "attention_tkg.py", "selective_expert_impl.py"} <= files
    for layer in (0, 1):
        b = est.layers[layer]
        assert b.wall > 0 and b.busy["tensor"] > 0 and b.busy.get("sync", 0) > 0


def test_top4_experts_are_read_not_all_32(two_layers):
    _, prof, _ = two_layers
    per_layer = prof.hbm_read_bytes / 2
    assert WEIGHT_BYTES_PER_LAYER <= per_layer <= 1.05 * WEIGHT_BYTES_PER_LAYER


def test_two_all_reduces_per_layer_over_eight_ranks(two_layers):
    _, prof, est = two_layers
    for layer in (0, 1):
        b = est.layers[layer]
        assert b.cc_count == 2 and b.cc_bytes == 2 * 3072 * 2  # attention and MoE outputs, [128, 24] bf16 each
        assert b.busy["cc"] > 0
    assert {(c["op"], c["group_size"]) for c in prof.collectives} == {("all_reduce", 8)}
    assert sum(c["count"] for c in prof.collectives) == 4


# ---- the published profile variants (benchmarks/prepare_gpt_oss_trees.sh) ------------------------------------------
GATE_UP = "mlp_tkg_gate_up_projection.py"
#: the checkout (and, for canonical, nkilib) env vars of each variant
VARIANT_ENVS = {"exp7": ("MK_GPTOSS_EXP7",), "exp6": ("MK_GPTOSS_EXP6",),
                "canonical": ("MK_GPTOSS_CANONICAL", "NKILIB_GPTOSS_CANONICAL")}


def _fake_checkout(root, selective_expert: str):
    """A directory the spec takes for a checkout: the kernel marker and a selective_expert_impl.py of that text."""
    (root / "megakernels" / "gpt_oss").mkdir(parents=True)
    (root / KERNEL).write_text("")
    (root / "nki_kernels" / "moe").mkdir(parents=True)
    (root / "nki_kernels" / "moe" / "selective_expert_impl.py").write_text(selective_expert)
    return str(root)


def test_variant_names_its_own_env_vars(monkeypatch, tmp_path):
    from fusegraph.perf.against_specs_gpt_oss import gpt_oss_megakernel

    with pytest.raises(ValueError, match="exp7"):
        gpt_oss_megakernel(layers=2, variant="exp5")
    for v, envs in VARIANT_ENVS.items():
        for e in envs:
            monkeypatch.delenv(e, raising=False)
        with pytest.raises(RuntimeError, match=envs[0]):
            gpt_oss_megakernel(layers=2, variant=v)
    # canonical needs its own nkilib: NKILIB does not stand in for it
    mk = _fake_checkout(tmp_path / "canon", "from nkilib.core.mlp.mlp_tkg.mlp_tkg_gate_up_projection import "
                                            "process_gate_up_projection\n")
    monkeypatch.setenv("MK_GPTOSS_CANONICAL", mk)
    with pytest.raises(RuntimeError, match="NKILIB_GPTOSS_CANONICAL"):
        gpt_oss_megakernel(layers=2, variant="canonical")


def test_a_tree_is_refused_for_a_variant_it_is_not(monkeypatch, tmp_path):
    from fusegraph.perf.against_specs_gpt_oss import gpt_oss_megakernel, moe_state

    ring = "    use_prefetch_ring = (\n        (not params.skip_gate_proj)\n    )\n"
    trees = {"exp7": ring, "exp6": ring.replace("= (", "= False and ("),
             "canonical": "from nkilib.core.mlp.mlp_tkg.mlp_tkg_gate_up_projection import process_gate_up_projection\n",
             "unknown": "pass\n"}
    dirs = {k: _fake_checkout(tmp_path / k, text) for k, text in trees.items()}
    assert {k: moe_state(d) for k, d in dirs.items()} == {k: k for k in trees}
    (tmp_path / "lib" / "nkilib").mkdir(parents=True)
    monkeypatch.setenv("NKILIB", str(tmp_path / "lib"))
    monkeypatch.setenv("NKILIB_GPTOSS_CANONICAL", str(tmp_path / "lib"))
    monkeypatch.setenv("MK_GPTOSS_EXP7", dirs["exp6"])
    with pytest.raises(RuntimeError, match="'exp6' MoE weight load, not 'exp7'"):
        gpt_oss_megakernel(layers=2, variant="exp7")
    monkeypatch.setenv("MK_GPTOSS_CANONICAL", dirs["exp7"])
    with pytest.raises(RuntimeError, match="'exp7' MoE weight load, not 'canonical'"):
        gpt_oss_megakernel(layers=2, variant="canonical")


def _run_variant(variant: str, layers: int = 2):
    missing = [e for e in VARIANT_ENVS[variant] if not os.environ.get(e)]
    if variant != "canonical" and not os.path.isdir(os.path.join(os.environ.get("NKILIB", ""), "nkilib")):
        missing.append("NKILIB")
    if missing:
        pytest.skip(f"set {', '.join(missing)} (benchmarks/prepare_gpt_oss_trees.sh prints them)")
    import sys
    import warnings

    from fusegraph.perf.against import load_spec, run_spec

    before = sys.modules.get("nkilib")
    spec = load_spec(f"fusegraph.perf.against_specs_gpt_oss:gpt_oss_megakernel_{variant}", layers=layers)
    assert sys.modules.get("nkilib") is before or variant != "canonical"  # the canonical nkilib left sys.modules
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the raw dge_mode ints nki-library passes
        prof = run_spec(spec)
    return spec, prof.trace[(0, 0)]


def _gate_up_weight_loads(events, layer: int):
    """The layer's gate/up weight DMAs (HBM -> SBUF, > 100 kB: not the biases) and matmuls, in program order:
    ``[("dma", dge_mode, bytes) | ("mm",)]``."""
    seq = []
    for e in events:
        if e.layer != layer or os.path.basename(e.file) != GATE_UP:
            continue
        if e.dma and "hbm" in e.dma["src_buffer"] and e.dma["bytes"] > 100_000:
            seq.append(("dma", e.dma["dge_mode"], e.dma["bytes"]))
        elif e.opcode == "nc_matmul":
            seq.append(("mm",))
    return seq


#: the gate (or up) weights of one expert on one rank: [3072 / 128 = 24 H1 tiles of 128, 384] bf16
EXPERT_PROJ_BYTES = 3072 * 384 * 2


_RUNS: dict = {}


def _cached_run(variant: str):
    if variant not in _RUNS:
        _RUNS[variant] = _run_variant(variant)
    return _RUNS[variant]


@pytest.fixture(scope="module", params=["exp7", "exp6", "canonical"])
def variant_run(request):
    return request.param, *_cached_run(request.param)


def test_variant_issues_the_weight_loads_its_profile_counted(variant_run):
    """Per layer, 4 experts x (gate, up): canonical loads each projection in 6 HWDGE DMAs of one 4-tile HTile
    (393,216 B; its profile: 1152 gate_up Sync DMA_DIRECT2D per token = 48 per layer, nkilib :470); exp 6 / exp 7
    in two H1 halves (1,179,648 B), the gate halves on HWDGE (Sync: 192 per token, gate_up :75/:81) and the up
    halves on SWDGE. The matmuls are the same: 576 per layer (4 experts x 2 x 24 H1 tiles x 3 I tiles)."""
    variant, spec, events = variant_run
    assert spec.layers == 2 and variant in spec.name
    for layer in (0, 1):
        seq = _gate_up_weight_loads(events, layer)
        dmas = [s for s in seq if s[0] == "dma"]
        assert sum(1 for s in seq if s[0] == "mm") == 576
        if variant == "canonical":
            assert dmas == [("dma", "hwdge", EXPERT_PROJ_BYTES // 6)] * (4 * 2 * 6)
        else:
            assert sorted(dmas) == sorted([("dma", "hwdge", EXPERT_PROJ_BYTES // 2)] * 8
                                          + [("dma", "swdge", EXPERT_PROJ_BYTES // 2)] * 8)


def test_variant_order_tells_the_prefetch_ring(variant_run):
    """Where the loads sit: exp 7's ring loads expert 0 and prefetches expert 1 (8 halves) before the first
    matmul; exp 6 issues only expert 0's gate halves first (the up halves follow the gate matmuls); canonical one
    HTile before its matmuls."""
    variant, _, events = variant_run
    first = {"exp7": 8, "exp6": 2, "canonical": 1}[variant]
    for layer in (0, 1):
        seq = _gate_up_weight_loads(events, layer)
        assert seq.index(("mm",)) == first


def test_canonical_runs_nki_library_from_its_own_commit():
    """The canonical gate/up and down projections are nki-library's (NKILIB_GPTOSS_CANONICAL), not the tree's
    vendored copies nor NKILIB's; a variant loaded after it imports NKILIB's nkilib again."""
    _, events = _cached_run("canonical")
    lib = os.path.realpath(os.environ["NKILIB_GPTOSS_CANONICAL"]) + os.sep
    mk = os.path.realpath(os.environ["MK_GPTOSS_CANONICAL"]) + os.sep
    files = {os.path.realpath(e.file) for e in events}
    mlp = {f for f in files if os.path.basename(f) in (GATE_UP, "mlp_tkg_down_projection.py")}
    assert len(mlp) == 2 and all(f.startswith(lib) for f in mlp)
    assert all(f.startswith((lib, mk)) for f in files if "nkilib" in f or "nki_kernels" in f)
    nkilib = os.path.realpath(os.environ.get("NKILIB", "")) + os.sep
    if nkilib == lib or not os.environ.get("MK_GPTOSS_EXP7"):
        return
    _, after = _run_variant("exp7")  # loaded afresh, after canonical
    assert any(os.path.realpath(e.file).startswith(nkilib) for e in after)
    assert not any(os.path.realpath(e.file).startswith(lib) for e in after)


def test_prepare_script_extracts_the_three_trees(tmp_path):
    """benchmarks/prepare_gpt_oss_trees.sh from the git mirrors (MK_GIT, NKILIB_GIT; skipped without them): exp 6
    is exp 7 but for the one ring line, canonical swaps in 82fe502's selective expert, its nkilib parses."""
    import ast
    import subprocess

    if not (os.path.isdir(os.environ.get("MK_GIT", "")) and os.path.isdir(os.environ.get("NKILIB_GIT", ""))):
        pytest.skip("set MK_GIT and NKILIB_GIT to the git dirs of nki-moe-megakernel and nki-library")
    from fusegraph.perf.against_specs_gpt_oss import moe_state

    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "prepare_gpt_oss_trees.sh")
    out = subprocess.run(["bash", script, str(tmp_path)], capture_output=True, text=True, check=True).stdout
    exports = dict(kv.split("=", 1) for kv in out.strip().splitlines()[-1].removeprefix("export ").split())
    assert set(exports) == {"MK_GPTOSS_EXP7", "MK_GPTOSS_EXP6", "MK_GPTOSS_CANONICAL", "NKILIB_GPTOSS_CANONICAL"}
    assert [moe_state(exports[f"MK_GPTOSS_{v.upper()}"]) for v in ("exp7", "exp6", "canonical")] == \
        ["exp7", "exp6", "canonical"]
    se = "nki_kernels/moe/selective_expert_impl.py"
    a, b = (open(os.path.join(exports[k], se)).read().splitlines() for k in ("MK_GPTOSS_EXP7", "MK_GPTOSS_EXP6"))
    assert len(a) == len(b) and sum(x != y for x, y in zip(a, b)) == 1
    lib = exports["NKILIB_GPTOSS_CANONICAL"]
    ast.parse(open(os.path.join(lib, "nkilib", "core", "mlp", "mlp.py")).read())
    assert os.path.exists(os.path.join(lib, "nkilib", "core", "mlp", "mlp_tkg", GATE_UP))
