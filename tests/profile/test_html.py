"""The memory viewer: ``MemoryReport.to_html``, ``Comparison.to_html`` and ``profile --html``.

Two kinds of tests. Structural ones read the written file: nothing in it points to the network,
and its JSON data block holds the report's buffers, timeline and peak. Browser ones open the
page in headless Chromium: the script runs to the end with nothing on the console (the page's
Content-Security-Policy turns any attempt to load a resource into a console message), the DOM
it builds names the buffers, ``#buffer=NAME`` opens that buffer's details, and a screenshot
shows a drawing. Without Chromium they are skipped, unless ``CI`` is set: then they fail.

On a plain-JAX transformer and a Flax NNX stack (loss and gradient, as written and through
``jaxmem.optimize``, one comparison page each) the browser tests read what the page shows: the
legend's "other" band under a tenth of the peak, every lane, legend entry and table cell naming
the model's line or the argument's pytree path (never XLA's name of the value), a buffer's call
chain, and the diff panel's rows adding up to each report's peak to the byte.
"""

import dataclasses
import html
import json
import os
import pathlib
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import urllib.parse

import jax
import matplotlib.image
import numpy as np
import pytest

import jaxmem
from benchmarks import attribution
from jaxmem import __main__ as cli
from jaxmem._src import plots
from jaxmem._src.format import format_bytes
from jaxmem._src.profile import html as html_page
from jaxmem._src.profile.timeline import group_label
from tests.profile import profile_targets
from tools.viewer_screenshot import BROWSERS, CONSOLE, FLAGS

ROOT = pathlib.Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
DATA_BLOCK = re.compile(
    r'<script type="application/json" id="jaxmem-data">(.*?)</script>', re.DOTALL
)


# --------------------------------------------------------------------------------------------
# Fixtures: a small MLP's gradient, and a comparison with its rematerialized twin


@pytest.fixture(scope="module")
def report():
    fn, args = profile_targets.mlp()
    return jaxmem.profile(fn, *args)


@pytest.fixture(scope="module")
def comparison():
    _, args = profile_targets.mlp()
    loss = profile_targets._mlp_loss
    return jaxmem.compare({"stock": jax.grad(loss), "remat": jax.grad(jax.checkpoint(loss))}, *args)


@pytest.fixture(scope="module")
def report_page(report, tmp_path_factory):
    return report.to_html(tmp_path_factory.mktemp("viewer") / "mlp.html")


@pytest.fixture(scope="module")
def comparison_page(comparison, tmp_path_factory):
    return comparison.to_html(tmp_path_factory.mktemp("viewer") / "cmp.html")


def _data(path) -> dict:
    (block,) = DATA_BLOCK.findall(pathlib.Path(path).read_text(encoding="utf-8"))
    return json.loads(block)


# --------------------------------------------------------------------------------------------
# Structural: the file alone


def _assert_self_contained(text: str) -> None:
    assert text.startswith("<!DOCTYPE html>")
    for needle in ("http://", "https://", "//cdn", "<link", "@import", "url(http"):
        assert needle not in text, needle
    loads = re.findall(r"<(?:script|img|iframe|link|source|embed)\b[^>]*\b(?:src|href)=", text)
    assert not loads, loads
    # The page forbids itself any other source than its inline script and style.
    assert "content=\"default-src 'none'; script-src 'unsafe-inline'" in text


def test_report_page_is_one_file_with_no_network(report_page):
    _assert_self_contained(report_page.read_text(encoding="utf-8"))


def test_comparison_page_is_one_file_with_no_network(comparison_page):
    _assert_self_contained(comparison_page.read_text(encoding="utf-8"))


def _node() -> str:
    """Node's path (for ``node --check``); without it, skip, or fail where ``CI`` is set."""
    found = shutil.which("node") or shutil.which("nodejs")
    if found:
        return found
    message = "no node on PATH to check the viewer's scripts; install it: apt-get install nodejs"
    if os.environ.get("CI"):
        pytest.fail(f"{message}. CI is set, so the syntax check must run.")
    pytest.skip(message)


@pytest.mark.parametrize("name", [a for a in html_page.ASSETS if a.endswith(".js")])
def test_the_viewer_scripts_parse(name, tmp_path):
    path = tmp_path / name
    path.write_text(html_page.asset(name), encoding="utf-8")
    done = subprocess.run([_node(), "--check", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_assets_are_package_files_that_close_no_tag_early():
    root = pathlib.Path(html_page.__file__).parent / "assets"
    assert sorted(p.name for p in root.iterdir()) == sorted(html_page.ASSETS)
    for name in html_page.ASSETS:
        text = html_page.asset(name)
        assert text == (root / name).read_text(encoding="utf-8") and len(text) > 500
        assert "</script" not in text.lower() and "</style" not in text.lower(), name
    with pytest.raises(ValueError, match="unknown viewer asset 'x.js'"):
        html_page.asset("x.js")


def _buffer_rows(buffers):
    return [
        (b.name, b.bytes, list(b.shape), b.dtype, b.kind, b.op_name, b.source, b.start, b.end)
        for b in buffers
    ]


def _data_rows(view):
    keys = ("name", "bytes", "shape", "dtype", "kind", "op_name", "source", "start", "end")
    return [tuple(b[k] for k in keys) for b in view["timeline"]["buffers"]]


def test_report_data_holds_the_buffers_timeline_and_peak(report, report_page):
    data = _data(report_page)
    assert data["kind"] == "report"
    (view,) = data["reports"]
    b = report.buffers
    assert view["name"] == report.name == "_mlp_loss"
    assert _data_rows(view) == [tuple(r) for r in _buffer_rows(b.buffers)]
    t = view["timeline"]
    assert t["peak_buffers"] == [buf.name for buf in report.peak_buffers]
    assert (t["peak_bytes"], t["peak_index"]) == (b.peak_bytes, b.peak_index)
    assert t["timeline"] == list(report.timeline)
    assert t["program"] == list(b.program)
    assert view["peak_bytes"] == report.peak_bytes
    figures = view["figures"]
    assert (figures["temp_bytes"], figures["argument_bytes"], figures["output_bytes"]) == (
        report.temp_bytes,
        report.argument_bytes,
        report.output_bytes,
    )
    tops = report.top_contributors(10)
    assert [(g["key"], g["bytes"], g["names"]) for g in t["top_contributors"]] == [
        (g.key, g.bytes, list(g.names)) for g in tops
    ]


def test_bands_are_those_of_the_png_timeline(report, report_page, monkeypatch, tmp_path):
    """The page's bands, labels and live bytes are what plot_timeline draws."""
    drawn = {}

    def live_timeline(layers, labels, peak_index, peak_bytes, title, feature):
        drawn.update(layers=np.asarray(layers), labels=list(labels), peak=peak_index)
        return real(layers, labels, peak_index, peak_bytes, title, feature)

    real = plots.live_timeline
    monkeypatch.setattr(plots, "live_timeline", live_timeline)
    report.plot_timeline(tmp_path / "t.png")
    t = _data(report_page)["reports"][0]["timeline"]
    assert [band["label"] for band in t["bands"]] == drawn["labels"]
    assert np.array_equal(np.array(t["layers"]), drawn["layers"])
    assert drawn["labels"][:-1] == [group_label(g) for g in report.top_contributors(6)]
    # Every point's bands add up to the timeline; each peak buffer is in its group's band.
    assert np.array(t["layers"]).sum(axis=0).tolist() == list(report.timeline)
    band_of = {buf["name"]: buf["band"] for buf in t["buffers"]}
    for i, g in enumerate(report.top_contributors(6)):
        assert {band_of[name] for name in g.names} == {i}, g


def test_comparison_data_holds_the_table_and_both_reports(comparison, comparison_page):
    data = _data(comparison_page)
    assert data["kind"] == "comparison" and data["baseline"] == "stock"
    assert [r["name"] for r in data["reports"]] == ["stock", "remat"]
    assert data["columns"] == ["temp", "argument", "output", "peak", "residual"]
    fields = ("temp_bytes", "argument_bytes", "output_bytes", "peak_bytes", "residual_bytes")
    for row, (label, rep) in zip(data["rows"], comparison.reports.items(), strict=True):
        assert row["label"] == label
        assert row["values"] == [getattr(rep, f) for f in fields]
        expected = [comparison.ratio(label, f) for f in fields]
        assert row["ratios"] == [r if np.isfinite(r) else None for r in expected]
    for view, rep in zip(data["reports"], comparison.reports.values(), strict=True):
        assert _data_rows(view) == [tuple(r) for r in _buffer_rows(rep.buffers.buffers)]
        assert view["timeline"]["program"] == list(rep.buffers.program)
        assert view["timeline"]["peak_bytes"] == rep.buffers.peak_bytes


def test_markup_in_names_stays_data(report, tmp_path):
    name = '</script><script>alert("x")</script> & <b>'
    page = dataclasses.replace(report, name=name).to_html(tmp_path / "odd.html")
    text = page.read_text(encoding="utf-8")
    assert text.count("</script>") == 3  # the boot script, the data block, the viewer
    assert _data(page)["reports"][0]["name"] == name
    assert f"<title>Memory of {html.escape(name)}" in text


def test_report_without_a_buffer_view_has_totals_only(report, tmp_path):
    bare = dataclasses.replace(report, buffers=None, buffer_error="no dump (a test)")
    (view,) = _data(bare.to_html(tmp_path / "bare.html"))["reports"]
    assert view["timeline"] is None and view["buffer_error"] == "no dump (a test)"
    assert view["figures"]["temp_bytes"] == report.temp_bytes


def test_cli_html_writes_the_viewer_next_to_the_plots(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(ROOT)
    out = tmp_path / "plots"
    status = cli.main(["profile", "tests.profile.profile_targets:mlp", "--out", str(out), "--html"])
    printed, err = capsys.readouterr()
    assert status == 0, err
    page = out / "mlp_memory.html"
    assert f"wrote {page}" in printed
    (view,) = _data(page)["reports"]
    assert view["name"] == "_mlp_loss"
    fn, args = profile_targets.mlp()
    expected = jaxmem.profile(fn, *args)
    assert view["timeline"]["peak_bytes"] == expected.buffers.peak_bytes
    assert {p.name for p in out.iterdir()} == {"mlp_memory.png", "mlp_timeline.png", page.name}
    # Without --html, no page.
    status = cli.main(["profile", "tests.profile.profile_targets:mlp", "--out", str(tmp_path)])
    assert status == 0 and not (tmp_path / "mlp_memory.html").exists()


# --------------------------------------------------------------------------------------------
# In a browser: headless Chromium

# The flags and the console pattern are the screenshot script's (tools/viewer_screenshot.py).


def _find_chromium() -> str:
    """Chromium's path; without one, skip, or fail where ``CI`` is set (CI must run these)."""
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    message = f"no Chromium ({', '.join(BROWSERS)}) on PATH; install it: apt-get install chromium"
    if os.environ.get("CI"):
        pytest.fail(f"{message}. CI is set, so the memory viewer's browser tests must run.")
    pytest.skip(message)


@pytest.fixture(scope="module")
def chromium():
    return _find_chromium()


def test_without_chromium_ci_fails_and_only_a_local_run_skips(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no browser on it
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI is set"):
        _find_chromium()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="apt-get install chromium"):
        _find_chromium()


@dataclasses.dataclass
class Loaded:
    """What Chromium printed for one page: the DOM after the scripts ran (without the scripts'
    own text, the data block included: what remains is what they built), console messages."""

    dom: str
    console: list[str]


def _open(chromium, url: str, *options: str) -> Loaded:
    with tempfile.TemporaryDirectory(prefix="jaxmem-chromium-") as profile:
        proc = subprocess.run(
            [chromium, *FLAGS, f"--user-data-dir={profile}", *options, url],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 0, proc.stderr[-4000:]
    dom = re.sub(r"<script\b.*?</script>", "", proc.stdout, flags=re.DOTALL)
    return Loaded(dom, [line for line in proc.stderr.splitlines() if CONSOLE.search(line)])


def _dom(chromium, path, fragment: str = "") -> Loaded:
    url = pathlib.Path(path).resolve().as_uri() + fragment
    return _open(chromium, url, "--virtual-time-budget=2000", "--dump-dom")


def _buffer_fragment(name: str, report: str | None = None) -> str:
    query = {"buffer": name} if report is None else {"report": report, "buffer": name}
    return "#" + urllib.parse.urlencode(query, quote_via=urllib.parse.quote)


def _attr_values(dom: str, attribute: str) -> list[str]:
    return [html.unescape(v) for v in re.findall(rf'\b{attribute}="([^"]*)"', dom)]


def _detail(dom: str, index: int = 0) -> tuple[str | None, dict[str, str]]:
    """The buffer a report's detail panel shows (its ``data-buffer``) and its fields' text."""
    match = re.search(rf'<section[^>]*id="detail-{index}"[^>]*>(.*?)</section>', dom, re.DOTALL)
    assert match, f"no detail panel {index}"
    shown = re.search(r'data-buffer="([^"]*)"', match.group(0).split(">", 1)[0])
    fields = {
        key: " ".join(html.unescape(re.sub(r"<[^>]+>", " ", text)).split())
        for key, text in re.findall(r'data-field="(\w+)"[^>]*>(.*?)</dd>', match.group(1), re.S)
    }
    return (html.unescape(shown.group(1)) if shown else None), fields


def test_report_page_runs_cleanly_and_lists_the_buffers(chromium, report, report_page):
    page = _dom(chromium, report_page)
    assert page.console == []
    assert 'data-viewer="ready"' in page.dom
    names = _attr_values(page.dom, "data-buffer")
    assert {b.name for b in report.buffers.buffers} <= set(names)
    assert [n for n in names if n in {b.name for b in report.peak_buffers}][:3] == [
        b.name
        for b in report.peak_buffers[:3]  # the lanes: largest first
    ]
    assert _detail(page.dom)[0] is None  # nothing selected
    assert f"peak {format_bytes(report.buffers.peak_bytes)}" in page.dom
    for group in report.top_contributors(3):
        assert html.escape(group_label(group), quote=False) in page.dom


def test_fragment_opens_a_buffers_details(chromium, report, report_page):
    buf = next(b for b in report.peak_buffers if b.source and b.shape)
    page = _dom(chromium, report_page, _buffer_fragment(buf.name))
    assert page.console == []
    shown, fields = _detail(page.dom)
    assert shown == buf.name
    assert fields["shape"] == f"{buf.dtype}[{', '.join(map(str, buf.shape))}]"
    assert fields["dtype"] == buf.dtype
    assert fields["kind"].startswith(buf.kind)
    assert fields["source"].startswith(os.path.basename(buf.source))
    assert buf.source in fields["source"]
    assert fields["op_name"] == buf.op_name
    assert fields["live_range"].startswith(f"points {buf.start}–{buf.end}")
    assert fields["at_peak"].startswith("live")


def test_fragment_with_an_unknown_buffer_says_so(chromium, report_page):
    page = _dom(chromium, report_page, _buffer_fragment("no.such.buffer"))
    assert page.console == []
    assert _detail(page.dom)[0] is None
    assert "No buffer named" in page.dom and "no.such.buffer" in page.dom


def test_comparison_page_shows_both_reports(chromium, comparison, comparison_page):
    remat = comparison.reports["remat"]
    buf = remat.peak_buffers[0]
    page = _dom(chromium, comparison_page, _buffer_fragment(buf.name, report="remat"))
    assert page.console == []
    assert _attr_values(page.dom, "data-report") == ["stock", "remat"]
    assert (_detail(page.dom, 0)[0], _detail(page.dom, 1)[0]) == (None, buf.name)
    assert _detail(page.dom, 1)[1]["dtype"] == buf.dtype
    names = set(_attr_values(page.dom, "data-buffer"))
    for rep in comparison.reports.values():
        assert {b.name for b in rep.peak_buffers} <= names
    for label in comparison.reports:  # the comparison table, one row per label
        assert re.search(rf'data-goto="\d">{label}</button>', page.dom), label


def test_report_without_a_buffer_view_loads(chromium, report, tmp_path):
    bare = dataclasses.replace(
        report, name="<odd & name>", buffers=None, buffer_error="no dump (a test)"
    )
    page = _dom(chromium, bare.to_html(tmp_path / "bare.html"))
    assert page.console == []
    assert 'data-viewer="ready"' in page.dom
    assert "no dump (a test)" in page.dom and "&lt;odd &amp; name&gt;" in page.dom


def test_screenshot_shows_the_page(chromium, report_page, tmp_path):
    shot = tmp_path / "viewer.png"
    url = report_page.resolve().as_uri()
    _open(chromium, url, f"--screenshot={shot}", "--window-size=1400,900")
    data = shot.read_bytes()
    assert data.startswith(PNG)
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert (width, height) == (1400, 900)
    pixels = matplotlib.image.imread(shot)[..., :3]
    colours = np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 50, "the screenshot is (nearly) blank"


def test_console_check_flags_errors_and_network_use(chromium, report_page, tmp_path):
    broken = tmp_path / "broken.html"
    broken.write_text("<!DOCTYPE html><p>x</p><script>notDefinedAnywhere();</script>")
    page = _dom(chromium, broken)
    assert page.console and "notDefinedAnywhere" in page.console[0]
    # The viewer page with a script from elsewhere added: its CSP blocks it, loudly.
    text = report_page.read_text(encoding="utf-8")
    fetching = tmp_path / "fetching.html"
    fetching.write_text(text.replace("</head>", '<script src="https://cdn.invalid/x.js">'
                                     "</script></head>", 1), encoding="utf-8")  # fmt: skip
    page = _dom(chromium, fetching)
    assert any("Content Security Policy" in line for line in page.console), page.console
    assert 'data-viewer="ready"' in page.dom  # blocked, and the viewer still runs


# --------------------------------------------------------------------------------------------
# Models as users write them: a plain-JAX transformer (benchmarks/optimize.py's make_loss) and a
# Flax NNX stack (nnx.vmap + nnx.scan of pre-LN blocks), 4 layers, width 128, batch 2 x 64
# tokens, each loss and its gradient, as written ("stock") and through jaxmem.optimize, one
# comparison page each, read back from the DOM Chromium built

OTHER_BELOW = 0.10  # the "other" band's share of the peak, at most

# What a label may be: the model's line ``file.py:LINE (function)`` (at the call and function
# folds ``file.py (function)``), an argument's pytree path, a buffer of no source by its kind;
# " (backward)" marks the backward pass.
LINE_LABEL = re.compile(r"[\w.-]+\.py(:\d+)? \([^()]*(\([^()]*\)[^()]*)*\)")
PATH_LABEL = re.compile(r"(params|state|x)(\['\w+'\]|\.\w+)*")
KIND_LABEL = re.compile(r"(temp|argument|output|constant|thread-local): no source")
# XLA's names of parameters: the pytree path mangled, numbered (``params__layers___w1__.1``).
MANGLED = re.compile(r"\w*__\w*\.\d+")


def _is_attribution(label: str) -> bool:
    label = label.removesuffix(" (backward)")
    return any(p.fullmatch(label) for p in (LINE_LABEL, PATH_LABEL, KIND_LABEL))


# The models of benchmarks/attribution.py at its sizes (attribution.SIZES), built on use.
MODELS = {"transformer": attribution.transformer, "nnx": attribution.nnx_stack}
CASES = [(model, of) for model in MODELS for of in ("loss", "grad")]


@dataclasses.dataclass
class ModelPage:
    """A model's comparison page (stock vs optimize) and what Chromium built of it."""

    case: str
    comparison: jaxmem.Comparison
    path: pathlib.Path
    page: Loaded


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def model_page(request, chromium, tmp_path_factory) -> ModelPage:
    model, of = request.param
    built = MODELS[model]()
    loss, args = built.loss, built.args
    fns = {"stock": loss, "optimize": jaxmem.optimize(loss)}
    if of == "grad":
        fns = {label: jax.grad(fn) for label, fn in fns.items()}
    cmp = jaxmem.compare(fns, *args)
    path = cmp.to_html(tmp_path_factory.mktemp("models") / f"{model}_{of}.html")
    return ModelPage(f"{model} {of}", cmp, path, _dom(chromium, path))


def _text(fragment: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


REPORT_START = re.compile(r'<section class="report[^"]*"\s+id="report-\d+"\s+data-report="([^"]*)"')


def _report_sections(dom: str) -> dict[str, str]:
    """Each report's part of the DOM, by its label (a report runs to the next one's start)."""
    starts = [(m.start(), html.unescape(m.group(1))) for m in REPORT_START.finditer(dom)]
    ends = [s for s, _ in starts[1:]] + [len(dom)]
    return {label: dom[s:e] for (s, label), e in zip(starts, ends, strict=True)}


UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}


def _bytes_shown(text: str) -> float:
    """``"1.16 MiB"`` -> its bytes, as shown (to the digits printed)."""
    value, unit = text.split()
    return float(value) * UNITS[unit]


def _legend(section: str) -> list[tuple[str, str]]:
    """The legend's bands as rendered: (label, size text)."""
    return [
        (html.unescape(label), size)
        for label, size in re.findall(
            r'<li data-band="\d+"[^>]*>.*?<span class="band-label">(.*?)</span>\s*<b>(.*?)</b>',
            section,
            re.DOTALL,
        )
    ]


def _peak_shown(section: str) -> str:
    (peak,) = re.findall(r'<text class="peak-label"[^>]*>peak ([^<]*)</text>', section)
    return peak


def _lane_labels(section: str) -> list[str]:
    """The lanes' labels without their sizes (``LABEL · 1.00 MiB``)."""
    texts = re.findall(r'<text class="lane-label"[^>]*>([^<]*)</text>', section)
    return [html.unescape(t).rsplit(" · ", 1)[0] for t in texts]


def test_model_pages_run_cleanly(model_page):
    assert model_page.page.console == []
    assert 'data-viewer="ready"' in model_page.page.dom
    assert set(_report_sections(model_page.page.dom)) == {"stock", "optimize"}


def test_the_other_band_holds_under_a_tenth_of_each_peak(model_page):
    """Read from the legend as rendered: the "other" band's size against the peak's label."""
    shares = {}
    for label, section in _report_sections(model_page.page.dom).items():
        legend = dict(_legend(section))
        peak = _bytes_shown(_peak_shown(section))
        other = _bytes_shown(legend.get("other", "0 B"))
        shares[label] = other / peak
        # The bands add up to the peak (each size rounded to the digits shown).
        assert sum(map(_bytes_shown, legend.values())) == pytest.approx(peak, rel=0.01)
        # The legend says which fold its bands use.
        (fold,) = re.findall(r'<li class="fold" data-fold="(\w+)">([^<]*):</li>', section)
        assert fold[1] == html_page.FOLD_NOTES[fold[0]]
    print(f"{model_page.case}: 'other' {', '.join(f'{k} {v:.1%}' for k, v in shares.items())}")
    assert all(share < OTHER_BELOW for share in shares.values()), (model_page.case, shares)


def test_every_label_names_the_attribution(model_page):
    """Lanes, legend and the buffer table name the model's line or the argument's path, never
    XLA's name of the value (``params__down__.1``, ``while.3{15}``)."""
    seen_paths = []
    for label, section in _report_sections(model_page.page.dom).items():
        report = model_page.comparison.reports[label]
        hlo_names = {b.name for b in report.buffers.buffers}
        lanes = _lane_labels(section)
        legend = [band for band, _ in _legend(section) if band != "other"]
        table = [
            html.unescape(t).strip()
            for t in re.findall(r'<td class="src" data-role="label"[^>]*>([^<]*)</td>', section)
        ]
        assert lanes and legend and len(table) == len(report.buffers.buffers)
        for text in lanes + legend + table:
            assert not MANGLED.search(text) and text not in hlo_names, (label, text)
            assert _is_attribution(text), (label, text)
        # The lanes are the largest buffers at the peak, each labelled as Python attributes it.
        expected = [html_page.buffer_label(b) for b in report.peak_buffers[: len(lanes)]]
        assert lanes == expected
        seen_paths += [t for t in lanes + legend if PATH_LABEL.match(t)]
    root = "state['blocks']" if model_page.case.startswith("nnx") else "params['"
    assert any(t.startswith(root) for t in seen_paths), seen_paths


def _diff_rows(panel: str) -> list[dict]:
    rows = []
    for attrs, cells in re.findall(r'<tr (data-status="[^"]*"[^>]*)>(.*?)</tr>', panel, re.S):
        status, a, b = re.search(
            r'data-status="(\w+)" data-a-bytes="(\d+)"\s+data-b-bytes="(\d+)"', attrs
        ).groups()
        source = _text(re.search(r'<td class="src"[^>]*>(.*?)</td>', cells, re.S).group(1))
        rows.append({"status": status, "a": int(a), "b": int(b), "source": source})
    return rows


def _exact_bytes(panel: str, role: str) -> tuple[int, int]:
    """The exact byte counts a footer row (``sum``, ``peak``) shows for a and b."""
    (row,) = re.findall(rf'<tr class="[^"]*" data-role="{role}".*?</tr>', panel, re.S)
    a, b = re.findall(r'<div class="muted exact">([\d,]+) B</div>', row)
    return int(a.replace(",", "")), int(b.replace(",", ""))


def test_diff_panel_rows_add_up_to_each_peak(model_page):
    dom, cmp = model_page.page.dom, model_page.comparison
    panels = re.findall(r'<section class="box diff"[^>]*>.*?</section>', dom, re.S)
    assert len(panels) == 1
    panel = panels[0]
    assert 'data-a="stock"' in panel and 'data-b="optimize"' in panel
    rows = _diff_rows(panel)
    expected = cmp.diff("stock", "optimize")
    assert sorted((r["source"], r["a"], r["b"], r["status"]) for r in rows) == sorted(
        (r.source, r.a_bytes, r.b_bytes, r.status) for r in expected.rows
    )
    # Grouped: freed, added, common (grown, shrunk, same), each row in its group.
    groups = re.findall(r'<tbody data-group="(\w+)">(.*?)</tbody>', panel, re.S)
    common = {"grown", "shrunk", "same"}
    for group, body in groups:
        statuses = {r["status"] for r in _diff_rows(body)}
        assert statuses and statuses <= ({group} if group != "common" else common), group
    assert [g for g, _ in groups] == [
        g for g, s in (("freed", {"freed"}), ("added", {"added"}), ("common", common))
        if any(r["status"] in s for r in rows)
    ]  # fmt: skip
    assert all(_is_attribution(r["source"]) for r in rows), [r["source"] for r in rows]
    # The sums the page shows are those of its rows, and each report's peak, to the byte.
    sums = _exact_bytes(panel, "sum")
    assert sums == (sum(r["a"] for r in rows), sum(r["b"] for r in rows))
    assert sums == _exact_bytes(panel, "peak")
    sections = _report_sections(dom)
    for label, total in zip(("stock", "optimize"), sums, strict=True):
        assert total == cmp.reports[label].buffers.peak_bytes
        assert format_bytes(total) == _peak_shown(sections[label])
    assert "do not add up" not in panel
    if model_page.case.endswith("grad"):
        # optimize changes what the gradient keeps: some rows differ, others are common.
        assert {r["status"] for r in rows} & {"added", "freed", "grown", "shrunk"}
        assert {r["status"] for r in rows} & common


def test_detail_panel_names_the_attribution_and_the_call_chain(chromium, model_page):
    report = model_page.comparison.reports["stock"]
    buf = max((b for b in report.peak_buffers if len(b.chain) > 1), key=lambda b: b.bytes)
    page = _dom(chromium, model_page.path, _buffer_fragment(buf.name, report="stock"))
    assert page.console == []
    shown, fields = _detail(page.dom, 0)
    assert shown == buf.name
    panel = re.search(r'<section[^>]*id="detail-0".*?</section>', page.dom, re.S).group(0)
    heading = re.search(r'<h3><span data-role="label">([^<]*)</span>', panel).group(1)
    assert html.unescape(heading) == html_page.buffer_label(buf)
    assert _is_attribution(html.unescape(heading)) and fields["name"] == buf.name
    # The call chain, innermost first, one file name per line (the full path as its title).
    chain = re.findall(r'<li title="([^"]*)">([^<]*)</li>', panel)
    assert [html.unescape(full) for full, _ in chain] == list(buf.chain)
    assert [html.unescape(short) for _, short in chain] == [
        c.rsplit(os.sep, 1)[-1] for c in buf.chain
    ]
    assert all(LINE_LABEL.fullmatch(html.unescape(short)) for _, short in chain)


# Hovers the first lane, then the chart at the peak near its floor, and copies each tooltip into
# the DOM (#tip-0, #tip-1): run after the viewer's script, as a user's pointer would.
HOVER = """<script>(function () {
  const tip = () => document.querySelector(".tooltip").innerHTML;
  const keep = (i, html) => {
    const d = document.createElement("section");
    d.id = "tip-" + i;
    d.innerHTML = html;
    document.body.appendChild(d);
  };
  const move = (target, x, y) => target.dispatchEvent(
    new MouseEvent("mousemove", {bubbles: true, clientX: x, clientY: y}));
  move(document.querySelector("rect.lane"), 5, 5);
  keep(0, tip());
  const svg = document.querySelector("[data-role=chart] svg"), r = svg.getBoundingClientRect();
  const x = Number(svg.querySelector("line.peak-line").getAttribute("x1"));
  move(svg, r.left + x * r.width / svg.viewBox.baseVal.width, r.top + 0.85 * r.height);
  keep(1, tip());
})();</script>"""


def test_tooltips_name_buffers_by_their_attribution(chromium, report, report_page, tmp_path):
    hovered = tmp_path / "hovered.html"
    text = report_page.read_text(encoding="utf-8")
    hovered.write_text(text.replace("</body>", HOVER + "</body>", 1), encoding="utf-8")
    page = _dom(chromium, hovered)
    assert page.console == []
    tips = dict(re.findall(r'<section id="tip-(\d)">(.*?)</section>', page.dom, re.S))
    assert set(tips) == {"0", "1"}, page.dom[-3000:]
    # A lane's tooltip: the buffer's label first; XLA's name only in its foot.
    first = report.peak_buffers[0]
    head = _text(re.search(r'<div class="tt-head">(.*?)</div>', tips["0"], re.S).group(1))
    assert head == f"{html_page.buffer_label(first)} · {format_bytes(first.bytes)}"
    assert f"XLA's {first.name}" in _text(tips["0"])
    # The chart's tooltip at the peak: the largest buffers of the band there, by their labels.
    largest = re.findall(r"<div>([^<]*)<code>", tips["1"].split("here:", 1)[1])
    labels = {html_page.buffer_label(b) for b in report.peak_buffers}
    assert largest and {html.unescape(t).strip() for t in largest} <= labels, largest
    names = {b.name for b in report.buffers.buffers}
    assert not {html.unescape(t).strip() for t in largest} & names


def test_comparison_data_holds_the_diff_of_the_baseline_with_each_report(comparison):
    view = html_page.comparison_view(comparison, [("temp_bytes", "temp")])
    assert view["diffs"] == [comparison.diff("stock", "remat").to_dict()]
    for d in view["diffs"]:
        assert sum(r["a_bytes"] for r in d["rows"]) == d["a_peak_bytes"]
        assert sum(r["b_bytes"] for r in d["rows"]) == d["b_peak_bytes"]
    # Three reports: the baseline against each other one; one without buffers is left out.
    stock, remat = comparison.reports["stock"], comparison.reports["remat"]
    bare = dataclasses.replace(remat, buffers=None, buffer_error="no dump (a test)")
    three = jaxmem.Comparison({"stock": stock, "remat": remat, "bare": bare, "again": stock})
    diffs = html_page.comparison_view(three, [("temp_bytes", "temp")])["diffs"]
    assert [(d["a"], d["b"]) for d in diffs] == [("stock", "remat"), ("stock", "again")]
    assert {r["status"] for r in diffs[1]["rows"]} == {"same"}
    no_base = jaxmem.Comparison({"bare": bare, "stock": stock})
    assert html_page.comparison_view(no_base, [("temp_bytes", "temp")])["diffs"] == []
