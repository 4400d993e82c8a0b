"""`sfm synth` writes SEG-Y that plain segyio reads with the requested layout, and data that looks seismic.

Every file is read back with segyio (or, for header positions segyio has no name for, as raw
bytes), never with sfm's own reader, so a broken writer cannot hide behind a matching reader.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import segyio

from sfm.cli import main
from sfm.errors import SFMError
from sfm.synth.geology import synthesize_volume
from sfm.synth.survey import SegyOptions, synth_survey, write_segy

REPO = Path(__file__).resolve().parents[2]
SHAPE = (6, 5, 64)  # IL, XL, NS: small, and IL != XL so a transposed cube cannot pass by accident
TRACE_BYTES = {1: 4, 3: 2, 5: 4, 8: 1}


def synth(tmp_path: Path, capsys, *args: str, name: str = "survey.sgy") -> dict:
    """Run `sfm synth` through the console entry point; return its JSON result."""
    out = tmp_path / name
    argv = ["synth", str(out), "--shape", *map(str, SHAPE), *args]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def read_cube(result: dict) -> np.ndarray:
    """Amplitude [IL, XL, NS] through plain segyio, opened with the layout the result reports."""
    layout = dict(iline=result["iline_byte"], xline=result["xline_byte"], endian=result["endian"])
    with segyio.open(result["segy"], **layout) as f:
        cube = segyio.tools.cube(f)
        return cube.transpose(1, 0, 2) if f.sorting == segyio.TraceSortingFormat.CROSSLINE_SORTING else cube


def raw_header_ints(path, byte: int, *, ns: int, sample_format: int, endian: str, width: int = 4) -> np.ndarray:
    """One signed trace header field for every trace, read as raw bytes [traces]."""
    record = 240 + ns * TRACE_BYTES[sample_format]
    data = np.fromfile(path, dtype=np.uint8, offset=3600).reshape(-1, record)
    order = ">" if endian == "big" else "<"
    return data[:, byte - 1 : byte - 1 + width].copy().view(f"{order}i{width}").ravel()


@pytest.fixture(scope="module")
def expected():
    """What the generator made for seed 0: amplitude float32 [IL, XL, NS], labels uint8 [IL, XL, NS]."""
    return synthesize_volume(SHAPE, 0)


# --- formats, byte order, header positions, sorting -----------------------------------------


@pytest.mark.parametrize("fmt", [1, 3, 5, 8])
def test_each_sample_format_reads_back(tmp_path, capsys, expected, fmt):
    result = synth(tmp_path, capsys, "--format", str(fmt))
    assert result["format"] == fmt

    with segyio.open(result["segy"]) as f:
        assert f.bin[segyio.BinField.Format] == fmt
        assert f.dtype == {1: np.float32, 3: np.int16, 5: np.float32, 8: np.int8}[fmt]
        assert f.samples[1] - f.samples[0] == 4.0
    assert os.path.getsize(result["segy"]) == 3600 + SHAPE[0] * SHAPE[1] * (240 + SHAPE[2] * TRACE_BYTES[fmt])

    cube, amplitude = read_cube(result), expected[0]
    assert cube.shape == SHAPE
    if fmt == 5:
        np.testing.assert_array_equal(cube, amplitude)
    elif fmt == 1:  # IBM float keeps 21-24 mantissa bits
        np.testing.assert_allclose(cube, amplitude, rtol=1e-6, atol=1e-6)
    else:
        assert np.corrcoef(cube.ravel(), amplitude.ravel())[0, 1] > 0.99
        int_max = np.iinfo(cube.dtype).max
        assert 0.85 * int_max <= np.abs(cube).max() <= int_max  # uses most of the integer range


def test_integer_samples_are_rounded_not_truncated(tmp_path):
    ramp = np.linspace(-1, 1, 2 * 3 * 16, dtype=np.float32).reshape(2, 3, 16)
    path = tmp_path / "ramp.sgy"
    write_segy(path, ramp, SegyOptions(sample_format=8))
    with segyio.open(path) as f:
        cube = segyio.tools.cube(f)
    scale = 0.9 * 127
    np.testing.assert_array_equal(cube, np.rint(ramp * scale).astype(np.int8))


def test_ibm_write_leaves_callers_array_alone(tmp_path):
    # segyio converts a float32 trace to IBM in place and back, which rounds the caller's values.
    amplitude = np.random.default_rng(1).standard_normal((2, 2, 16)).astype(np.float32)
    before = amplitude.copy()
    write_segy(tmp_path / "ibm.sgy", amplitude, SegyOptions(sample_format=1))
    np.testing.assert_array_equal(amplitude, before)


@pytest.mark.parametrize("endian", ["big", "little"])
def test_endianness(tmp_path, capsys, expected, endian):
    result = synth(tmp_path, capsys, "--endian", endian)
    raw = Path(result["segy"]).read_bytes()
    assert raw[3224:3226] == (b"\x00\x05" if endian == "big" else b"\x05\x00")  # binary header format code

    np.testing.assert_array_equal(read_cube(result), expected[0])

    wrong = "little" if endian == "big" else "big"
    try:
        with segyio.open(result["segy"], endian=wrong) as f:
            garbage = len(f.samples) != SHAPE[2] or list(f.ilines) != list(range(100, 100 + SHAPE[0]))
    except RuntimeError:
        garbage = True
    assert garbage


@pytest.mark.parametrize("iline_byte, xline_byte", [(9, 21), (17, 13), (233, 237)])
def test_custom_byte_locations_open_in_segyio(tmp_path, capsys, expected, iline_byte, xline_byte):
    result = synth(tmp_path, capsys, "--iline-byte", str(iline_byte), "--xline-byte", str(xline_byte))
    with segyio.open(result["segy"], iline=iline_byte, xline=xline_byte) as f:
        assert list(f.ilines) == list(range(100, 100 + SHAPE[0]))
        assert list(f.xlines) == list(range(300, 300 + SHAPE[1]))
        assert f.header[0][segyio.TraceField.CDP_X] == 60500000  # coordinates untouched
    np.testing.assert_array_equal(read_cube(result), expected[0])

    with pytest.raises(RuntimeError):  # nothing at the default 189/193 any more
        segyio.open(result["segy"]).close()


@pytest.mark.parametrize("sorting", ["inline", "crossline"])
def test_byte_locations_segyio_has_no_name_for(tmp_path, capsys, sorting):
    # Bytes 10 and 206 start no segyio field: check the raw header, in both byte orders.
    for endian in ("big", "little"):
        args = ["--iline-byte", "10", "--xline-byte", "206", "--endian", endian, "--sorting", sorting]
        result = synth(tmp_path, capsys, *args)
        kw = dict(ns=SHAPE[2], sample_format=5, endian=endian)
        il, xl = raw_header_ints(result["segy"], 10, **kw), raw_header_ints(result["segy"], 206, **kw)
        grid_il, grid_xl = np.meshgrid(100 + np.arange(SHAPE[0]), 300 + np.arange(SHAPE[1]), indexing="ij")
        if sorting == "crossline":
            grid_il, grid_xl = grid_il.T, grid_xl.T
        np.testing.assert_array_equal(il, grid_il.ravel())
        np.testing.assert_array_equal(xl, grid_xl.ravel())
        np.testing.assert_array_equal(raw_header_ints(result["segy"], 71, width=2, **kw), -100)


def test_crossline_sorting(tmp_path, capsys):
    inline = synth(tmp_path, capsys, name="il.sgy")
    crossline = synth(tmp_path, capsys, "--sorting", "crossline", name="xl.sgy")
    assert crossline["sorting"] == "crossline"

    with segyio.open(inline["segy"]) as f:
        assert f.sorting == segyio.TraceSortingFormat.INLINE_SORTING
        il_cube = segyio.tools.cube(f)
    with segyio.open(crossline["segy"]) as f:
        assert f.sorting == segyio.TraceSortingFormat.CROSSLINE_SORTING
        # traces run inline-fastest: the second trace is the next inline on the first crossline
        assert (f.header[1][189], f.header[1][193]) == (101, 300)
        xl_cube = segyio.tools.cube(f)
    assert xl_cube.shape == (SHAPE[1], SHAPE[0], SHAPE[2])
    np.testing.assert_array_equal(xl_cube.transpose(1, 0, 2), il_cube)
    np.testing.assert_array_equal(np.load(crossline["faults"]), np.load(inline["faults"]))


# --- headers ---------------------------------------------------------------------------------


def test_trace_headers_and_cdp_coordinates(tmp_path, capsys):
    result = synth(tmp_path, capsys)
    ni, nx, ns = SHAPE
    with segyio.open(result["segy"]) as f:
        field = lambda key: f.attributes(key)[:].reshape(ni, nx)  # noqa: E731  [IL, XL] in inline order
        np.testing.assert_array_equal(field(segyio.TraceField.SourceGroupScalar), -100)
        np.testing.assert_array_equal(field(segyio.TraceField.TRACE_SEQUENCE_LINE).ravel(), np.arange(1, ni * nx + 1))
        np.testing.assert_array_equal(field(segyio.TraceField.offset), 0)
        np.testing.assert_array_equal(field(segyio.TraceField.TRACE_SAMPLE_COUNT), ns)
        np.testing.assert_array_equal(field(segyio.TraceField.TRACE_SAMPLE_INTERVAL), 4000)
        assert len(np.unique(field(segyio.TraceField.CDP))) == ni * nx
        assert f.bin[segyio.BinField.Samples] == ns and f.bin[segyio.BinField.Interval] == 4000
        x = field(segyio.TraceField.CDP_X) / 100.0
        y = field(segyio.TraceField.CDP_Y) / 100.0
        text = f.text[0].decode("ascii")  # segyio decodes the EBCDIC header
    assert Path(result["segy"]).read_bytes()[:1] == b"\xc3"  # 'C' in EBCDIC
    assert "SYNTHETIC" in text and "SEED 0" in text and "INLINE BYTE 189" in text

    assert (x[0, 0], y[0, 0]) == (605000.00, 6073000.00)
    along_inline = np.hypot(np.diff(x, axis=1), np.diff(y, axis=1))  # next crossline, same inline
    across = np.hypot(np.diff(x, axis=0), np.diff(y, axis=0))  # next inline
    np.testing.assert_allclose(along_inline, 25.0, atol=0.02)
    np.testing.assert_allclose(across, 25.0, atol=0.02)
    dx_inline, dy_inline = np.diff(x, axis=1)[:-1, :], np.diff(y, axis=1)[:-1, :]
    dx_across, dy_across = np.diff(x, axis=0)[:, :-1], np.diff(y, axis=0)[:, :-1]
    np.testing.assert_allclose(dx_inline * dx_across + dy_inline * dy_across, 0.0, atol=1.0)  # a square grid
    azimuth = np.degrees(np.arctan2(y[0, -1] - y[0, 0], x[0, -1] - x[0, 0]))
    assert 1.0 < abs(azimuth) < 89.0  # rotated, not axis-aligned


# --- determinism, labels, the data itself ------------------------------------------------------


def test_same_seed_same_bytes_through_subprocess(tmp_path):
    def run(name: str, seed: int) -> dict:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "sfm.cli", "synth", str(tmp_path / name), "--shape", "5", "4", "32"]
        cmd += ["--seed", str(seed)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        return json.loads(proc.stdout)

    a, b, c = run("a.sgy", 7), run("b.sgy", 7), run("c.sgy", 8)
    assert a == {
        "segy": str(tmp_path / "a.sgy"), "faults": str(tmp_path / "a.faults.npy"), "shape": [5, 4, 32],
        "format": 5, "endian": "big", "iline_byte": 189, "xline_byte": 193, "sorting": "inline", "seed": 7,
    }
    assert Path(a["segy"]).read_bytes() == Path(b["segy"]).read_bytes()
    assert Path(a["faults"]).read_bytes() == Path(b["faults"]).read_bytes()
    assert Path(a["segy"]).read_bytes() != Path(c["segy"]).read_bytes()


def test_fault_labels_beside_the_segy(tmp_path, capsys, expected):
    result = synth(tmp_path, capsys, name="deep/er/survey.sgy")
    assert result["faults"] == str(tmp_path / "deep/er/survey.faults.npy")
    assert sorted(os.listdir(tmp_path / "deep/er")) == ["survey.faults.npy", "survey.sgy"]  # no temp files left

    labels = np.load(result["faults"])
    assert labels.shape == SHAPE and labels.dtype == np.uint8
    assert set(np.unique(labels)) == {0, 1}
    assert 0.0 < labels.mean() < 0.5
    np.testing.assert_array_equal(labels, expected[1])

    assert synth_survey(tmp_path / "other.segy", shape=SHAPE)["faults"] == str(tmp_path / "other.faults.npy")
    assert synth_survey(tmp_path / "noext", shape=SHAPE)["faults"] == str(tmp_path / "noext.faults.npy")


def test_failed_write_leaves_no_partial_survey(tmp_path, monkeypatch):
    import sfm.synth.survey

    def broken_write(path, *args, **kwargs):
        Path(path).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(sfm.synth.survey, "write_segy", broken_write)
    with pytest.raises(OSError):
        synth_survey(tmp_path / "survey.sgy", shape=SHAPE)
    assert os.listdir(tmp_path) == []


def test_faults_break_lateral_continuity():
    # Neighbouring traces correlate less in windows a labelled fault crosses than elsewhere: the labels
    # sit where the layers are offset. A fault offsets the neighbours across its strike, so per volume
    # the clearer of the inline and crossline directions counts (a strike along one axis leaves that
    # axis's neighbours intact).
    gaps = []
    for seed in range(6):
        amplitude, labels = synthesize_volume((48, 48, 128), seed)
        windows = amplitude.reshape(48, 48, 8, 16)  # [IL, XL, window, 16 samples]
        faulted = labels.reshape(48, 48, 8, 16).any(axis=-1)
        per_axis = []
        for axis in (0, 1):
            a, b = (np.take(windows, range(s, s + 47), axis=axis) for s in (0, 1))
            at_fault = np.take(faulted, range(47), axis=axis) | np.take(faulted, range(1, 48), axis=axis)
            assert 0 < at_fault.mean() < 0.6
            corr = (a * b).sum(-1) / np.sqrt((a * a).sum(-1) * (b * b).sum(-1))
            per_axis.append(corr[~at_fault].mean() - corr[at_fault].mean())
        gaps.append(max(per_axis))
    assert min(gaps) > 0 and np.mean(gaps) > 0.04


def test_data_looks_seismic():
    amplitude, _ = synthesize_volume((16, 16, 256), 5)
    assert amplitude.dtype == np.float32 and amplitude.shape == (16, 16, 256)
    assert abs(float(amplitude.mean())) < 0.05 and float(amplitude.std()) > 0.5

    spectrum = np.abs(np.fft.rfft(amplitude, axis=-1)).mean(axis=(0, 1))
    freqs = np.fft.rfftfreq(256, d=0.004)
    assert 15.0 <= freqs[spectrum.argmax()] <= 45.0

    # layered: neighbouring traces look alike, unlike noise
    a, b = amplitude[:, :-1].reshape(-1, 256), amplitude[:, 1:].reshape(-1, 256)
    neighbour_corr = np.mean(np.sum(a * b, axis=1) / np.sqrt(np.sum(a * a, axis=1) * np.sum(b * b, axis=1)))
    assert neighbour_corr > 0.6

    assert not np.array_equal(amplitude, synthesize_volume((16, 16, 256), 6)[0])


# --- user errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, option",
    [
        (["--iline-byte", "300"], "--iline-byte"),
        (["--xline-byte", "0"], "--xline-byte"),
        (["--xline-byte", "183"], "--xline-byte"),  # overlaps CDP_X
        (["--iline-byte", "69"], "--iline-byte"),  # overlaps the coordinate scalar
        (["--iline-byte", "193", "--xline-byte", "195"], "--xline-byte"),  # overlap each other
        (["--shape", "0", "4", "4"], "--shape"),
        (["--shape", "4", "4", "4"], "--shape"),  # NS < 8
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, args, option):
    out = tmp_path / "bad.sgy"
    argv = ["synth", str(out), *(["--shape", "4", "4", "16"] if "--shape" not in args else []), *args]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and option in captured.err
    assert captured.err.startswith("sfm synth: error:")
    assert os.listdir(tmp_path) == []


def test_bad_input_exit_status_from_subprocess(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "sfm.cli", "synth", str(tmp_path / "x.sgy"), "--iline-byte", "300"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "--iline-byte 300" in proc.stderr


def test_library_raises_sfm_error():
    with pytest.raises(SFMError, match="--endian"):
        synth_survey("/tmp/never-written.sgy", shape=(4, 4, 16), endian="middle")
    with pytest.raises(SFMError, match="--format"):
        synth_survey("/tmp/never-written.sgy", shape=(4, 4, 16), sample_format=2)
