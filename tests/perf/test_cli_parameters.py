"""``--parameters sourced|<calibration>`` on the commands that print modeled times (``fusegraph bench``, its
``--against`` mode, ``fusegraph kernel --profile``): the set is used, every printed table names it, and a set
that does not cover the target is one clear message (exit 2) before any work. Tiny models, one layer."""
import json
import textwrap

import pytest

from fusegraph.cli import main
from fusegraph.perf.params import calibrations

CAL = "o1_hand_megakernel"


def _bench(tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    rc = main(["bench", "--models", "llama-tiny", "--layers", "1", "--cache-len", "16", "--no-per-op",
               "--json", str(out), *extra])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def test_bench_uses_and_labels_the_selected_set(tmp_path, capsys):
    assert calibrations()[CAL]["target"] == "trn3"
    rc, cal = _bench(tmp_path, "cal", "--parameters", CAL)  # no --targets: the calibration's own target
    text = capsys.readouterr().out
    assert rc == 0 and cal["parameter_set"] == CAL and [r["target"] for r in cal["rows"]] == ["trn3"]
    titles = [ln for ln in text.splitlines() if ln.startswith(("Whole model on ONE core", "Modeled time per"))]
    assert len(titles) == 2 and all(ln.endswith(f"[cost-model parameters: {CAL}]") for ln in titles)
    rc, src = _bench(tmp_path, "src", "--targets", "trn3")
    text = capsys.readouterr().out
    assert rc == 0 and src["parameter_set"] == "sourced" and "[cost-model parameters: sourced]" in text
    # the calibrated values are the ones costed (they change the modeled step)
    assert cal["rows"][0]["megakernel_ms"] != pytest.approx(src["rows"][0]["megakernel_ms"], rel=1e-3)


def test_bench_refuses_an_unknown_set_or_a_target_it_does_not_cover(tmp_path, capsys):
    rc, data = _bench(tmp_path, "bad", "--parameters", "nope")
    err = capsys.readouterr().err
    assert rc == 2 and data is None and "unknown parameter set 'nope'" in err and CAL in err
    assert "Traceback" not in err
    rc, data = _bench(tmp_path, "trn2", "--parameters", CAL, "--targets", "trn2")
    err = capsys.readouterr().err
    assert rc == 2 and data is None
    assert f"parameter set '{CAL}' has values for trn3 only, not trn2" in err and len(err.strip().splitlines()) == 1


def test_kernel_profile_names_the_set(tmp_path, capsys):
    out = tmp_path / "k.py"
    assert main(["kernel", "--model", "qwen3-moe-tiny", "--layers", "1", "--target", "trn3", "--out", str(out),
                 "--profile", "--parameters", CAL]) == 0
    assert f"modeled on trn3 (one core, cost-model parameters: {CAL})" in capsys.readouterr().err
    assert main(["kernel", "--model", "qwen3-moe-tiny", "--layers", "1", "--out", str(out), "--profile",
                 "--parameters", CAL]) == 2  # default target trn2: refused before the build
    assert "has values for trn3 only, not trn2" in capsys.readouterr().err


SPEC = """
import nki
import nki.isa as nisa
import nki.language as nl
import ml_dtypes
from fusegraph.nkisim import Abstract
from fusegraph.perf.against import KernelSpec


@nki.jit
def one_layer(x, w):
    out = nl.ndarray((128, 4), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    x_sb = nl.ndarray((128, 4), dtype=nl.bfloat16, buffer=nl.sbuf)
    w_sb = nl.ndarray((128, 128), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_sb, src=x)
    nisa.dma_copy(dst=w_sb, src=w)
    ps = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=ps, stationary=w_sb, moving=x_sb)
    nisa.activation(dst=x_sb, op=nl.relu, data=ps)
    nisa.dma_copy(dst=out, src=x_sb)
    return out


def spec(layers=None):
    bf = ml_dtypes.bfloat16
    return KernelSpec(kernel=one_layer, args=[Abstract((128, 4), bf), Abstract((128, 128), bf)], target="trn3",
                      name="one-layer")
"""


def test_bench_against_uses_and_labels_the_set(tmp_path, capsys):
    spec = tmp_path / "one_layer_spec.py"
    spec.write_text(textwrap.dedent(SPEC))
    walls = {}
    for ps in ("sourced", CAL):
        out = tmp_path / f"against-{ps}.json"
        assert main(["bench", "--against", str(spec), "--models", "llama-tiny", "--layers", "1", "--cache-len", "16",
                     "--parameters", ps, "--json", str(out)]) == 0
        head = capsys.readouterr().out.splitlines()[0]
        assert head.endswith(f"[cost-model parameters: {ps}]")
        data = json.loads(out.read_text())
        res = data["results"][0]
        assert data["parameter_set"] == ps and res["parameter_set"] == ps
        assert res["theirs"]["parameter_set"] == ps and res["fusegraph"]["parameter_set"] == ps
        walls[ps] = res["theirs"]["per_layer_s"]["wall"]
    assert walls[CAL] != pytest.approx(walls["sourced"], rel=1e-3)
    # the spec's kernel runs on trn3: a trn2 request with the trn3 calibration is refused before any costing
    assert main(["bench", "--against", str(spec), "--targets", "trn2", "--parameters", CAL]) == 2
    assert "has values for trn3 only, not trn2" in capsys.readouterr().err
