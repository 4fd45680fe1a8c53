"""The HTML report: self-contained, renders the graph and the tables, readable at 1280 px (headless Chromium)."""
import os
import re
import shutil
import struct
import subprocess

import pytest

from fusegraph.modelperf import html

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get install -y chromium); "
                             "the HTML report's browser rendering test is skipped")


@pytest.fixture(scope="module")
def report_file(tiny_perf, tmp_path_factory):
    path = tmp_path_factory.mktemp("html") / "report.html"
    html.write_perf(str(path), tiny_perf)
    return path


def test_report_structure(report_file, tiny_perf):
    text = report_file.read_text()
    # self-contained: no external scripts, styles, images or fonts
    assert not re.search(r'<(script|link|img|iframe)[^>]+(src|href)=', text)
    assert "@import" not in text and "url(" not in text
    G = tiny_perf.program.graph
    ops = [n for n, d in G.nodes(data=True) if d["kind"] == "op"]
    assert text.count("<circle class=\"node") == len(ops)  # 2 layers: every op is drawn
    for tid in ("region-table", "decision-log", "strategy-table", "kernel-regions", "top-lines", "params-table",
                "layer-chart", "strategy-chart", "program-graph"):
        assert f'id="{tid}"' in text, tid
    # attribution columns: kernel line -> pattern -> ATen ops -> model module
    assert "fusegraph.moe_experts" in text and "model.layers.0.mlp.experts" in text and "aten." in text


def test_unmatched_ops_are_highlighted(tiny_perf):
    unmatched = {n for n, d in tiny_perf.program.graph.nodes(data=True) if d["kind"] == "op"}
    some = sorted(unmatched)[:3]
    region_of = {n: 0 for n in unmatched if n not in some}
    from fusegraph.perf.graphsvg import render_graph

    svg = render_graph(tiny_perf.program, region_of, {}, {0: "decoder_stack"}, unmatched=some)
    assert svg.count('class="node unmatched"') >= 3
    assert "unmatched op (fallback path)" in svg


def test_renders_without_a_kernel_or_a_capture():
    text = html.render(title="empty")
    assert "<h1>empty</h1>" in text and "No captured program" in text


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


@needs_chromium
def test_chromium_renders_graph_and_tables(report_file, tmp_path):
    profile = tmp_path / "chromium-profile"
    cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--window-size=1280,900", "--dump-dom",
           report_file.as_uri()]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    m = re.search(r'data-rendered="(\d+)"', dom)
    assert m and int(m.group(1)) > 50, "the inline script did not run or found no graph nodes"
    assert int(re.search(r'data-tables="(\d+)"', dom).group(1)) >= 6
    assert "<svg" in dom and 'id="region-table"' in dom and 'id="top-lines"' in dom
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--window-size=1280,2000",
                    f"--screenshot={shot}", report_file.as_uri()], capture_output=True, timeout=120)
    w, h = _png_size(shot)
    assert (w, h) == (1280, 2000) and shot.stat().st_size > 40_000  # a real page, not a blank one
