"""The MDIO layout of a survey store (``ingest.layout = "mdio"``): what MDIO 1.1.3's own tools read beside
sfm's arrays and attributes.

MDIO's reader (``mdio.open_mdio``, xarray over Zarr v3) and exporter (``mdio.mdio_to_segy``) expect:

- root attributes ``apiVersion``, ``name`` (the template: PostStack3DTime or PostStack3DDepth) and
  ``attributes`` (survey and gather type, the default variable), :func:`root_attributes`;
- the sample axis named ``time`` or ``depth`` (``ingest.domain``), on ``amplitude`` and as its coordinate;
- ``statsV1`` on ``amplitude``: count, sum, sum of squares, min and max of the live samples, :func:`stats_v1`;
- ``segy_file_header``: a scalar array whose attributes hold the textual header (40 lines of 80
  characters) and the binary header in the ``segy`` library's rev-1 field names, :func:`file_header_attributes`;
- ``headers`` [inline, crossline]: every trace's rev-1 header fields, :data:`TRACE_HEADER_FIELDS`, decoded
  from the 240-byte headers the ingest pass reads with the samples (:func:`decode_trace_headers`).

No ``createdOn``: MDIO does not read it, and a date would make two ingests of the same file differ.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from sfm.errors import SFMError

MDIO_VERSION = "1.1.3"  # the MDIO release whose layout the store follows
TEMPLATES = {"time": "PostStack3DTime", "depth": "PostStack3DDepth"}
HEADER_BYTES = 240
HEADER_CODEC = {"cname": "zstd", "clevel": 5, "shuffle": "shuffle"}  # MDIO's own for headers

# SEG-Y rev 1 trace header: (name as in the ``segy`` library, 1-based byte, bytes); signed big- or little-endian
# integers. Bytes 233-240 are unassigned and not kept (as MDIO keeps them).
_TRACE_TABLE = """
trace_seq_num_line 1 4; trace_seq_num_reel 5 4; orig_field_record_num 9 4; trace_num_orig_record 13 4;
energy_source_point_num 17 4; ensemble_num 21 4; trace_num_ensemble 25 4; trace_id_code 29 2;
vertically_summed_traces 31 2; horizontally_stacked_traces 33 2; data_use 35 2; source_to_receiver_distance 37 4;
receiver_group_elevation 41 4; source_surface_elevation 45 4; source_depth_below_surface 49 4;
receiver_datum_elevation 53 4; source_datum_elevation 57 4; source_water_depth 61 4; receiver_water_depth 65 4;
elevation_depth_scalar 69 2; coordinate_scalar 71 2; source_coord_x 73 4; source_coord_y 77 4; group_coord_x 81 4;
group_coord_y 85 4; coordinate_unit 89 2; weathering_velocity 91 2; subweathering_velocity 93 2;
source_uphole_time 95 2; group_uphole_time 97 2; source_static_correction 99 2; receiver_static_correction 101 2;
total_static_applied 103 2; lag_time_a 105 2; lag_time_b 107 2; delay_recording_time 109 2; mute_time_start 111 2;
mute_time_end 113 2; samples_per_trace 115 2; sample_interval 117 2; instrument_gain_type 119 2;
instrument_gain_const 121 2; instrument_gain_initial 123 2; correlated_data 125 2; sweep_freq_start 127 2;
sweep_freq_end 129 2; sweep_length 131 2; sweep_type 133 2; sweep_taper_start 135 2; sweep_taper_end 137 2;
taper_type 139 2; alias_filter_freq 141 2; alias_filter_slope 143 2; notch_filter_freq 145 2;
notch_filter_slope 147 2; low_cut_freq 149 2; high_cut_freq 151 2; low_cut_slope 153 2; high_cut_slope 155 2;
year_recorded 157 2; day_of_year 159 2; hour_of_day 161 2; minute_of_hour 163 2; second_of_minute 165 2;
time_basis_code 167 2; trace_weighting_factor 169 2; group_num_roll_switch 171 2; group_num_first_trace 173 2;
group_num_last_trace 175 2; gap_size 177 2; taper_overtravel 179 2; cdp_x 181 4; cdp_y 185 4; inline 189 4;
crossline 193 4; shot_point 197 4; shot_point_scalar 201 2; trace_value_unit 203 2;
transduction_const_mantissa 205 4; transduction_const_exponent 209 2; transduction_unit 211 2;
device_trace_id 213 2; times_scalar 215 2; source_type_orientation 217 2; source_energy_dir_mantissa 219 4;
source_energy_dir_exponent 223 2; source_measurement_mantissa 225 4; source_measurement_exponent 229 2;
source_measurement_unit 231 2
"""
# SEG-Y rev 1 binary header (bytes 3201-3600): the same kind of table. The revision (bytes 3501-3502) is
# kept as segy_revision_major / segy_revision_minor, as MDIO's import writes it.
_BINARY_TABLE = """
job_id 3201 4; line_num 3205 4; reel_num 3209 4; data_traces_per_ensemble 3213 2; aux_traces_per_ensemble 3215 2;
sample_interval 3217 2; orig_sample_interval 3219 2; samples_per_trace 3221 2; orig_samples_per_trace 3223 2;
data_sample_format 3225 2; ensemble_fold 3227 2; trace_sorting_code 3229 2; vertical_sum_code 3231 2;
sweep_freq_start 3233 2; sweep_freq_end 3235 2; sweep_length 3237 2; sweep_type_code 3239 2; sweep_trace_num 3241 2;
sweep_taper_start 3243 2; sweep_taper_end 3245 2; taper_type_code 3247 2; correlated_data_code 3249 2;
binary_gain_code 3251 2; amp_recovery_code 3253 2; measurement_system_code 3255 2; impulse_polarity_code 3257 2;
vibratory_polarity_code 3259 2; fixed_length_trace_flag 3503 2; num_extended_text_headers 3505 2
"""
# EBCDIC -> ASCII as the ``segy`` library (MDIO's SEG-Y layer) decodes and, inverted, encodes textual headers:
# the POSIX ``dd conv=ascii`` table, which differs from Python's cp037 for [ ] ! | ^ and the non-ASCII bytes
_EBCDIC_TO_ASCII = bytes.fromhex(
    "000102039c09867f978d8e0b0c0d0e0f101112139d8508871819928f1c1d1e1f80818283840a171b88898a8b8c050607909116939495"
    "960498999a9b14159e1a20a0a1a2a3a4a5a6a7a85b2e3c282b2126a9aaabacadaeafb0b15d242a293b5e2d2fb2b3b4b5b6b7b8b97c2c"
    "255f3e3fbabbbcbdbebfc0c1c2603a2340273d22c3616263646566676869c4c5c6c7c8c9ca6a6b6c6d6e6f707172cbcccdcecfd0d17e"
    "737475767778797ad2d3d4d5d6d7d8d9dadbdcdddedfe0e1e2e3e4e5e6e77b414243444546474849e8e9eaebeced7d4a4b4c4d4e4f50"
    "5152eeeff0f1f2f35c9f535455565758595af4f5f6f7f8f930313233343536373839fafbfcfdfeff")


def _table(text: str) -> tuple[tuple[str, int, int], ...]:
    rows = (item.split() for item in text.replace("\n", " ").split(";") if item.strip())
    return tuple((name, int(byte), int(width)) for name, byte, width in rows)


TRACE_HEADER_FIELDS = _table(_TRACE_TABLE)
BINARY_HEADER_FIELDS = _table(_BINARY_TABLE)
HEADER_DTYPE = np.dtype([(name, f"<i{width}") for name, _, width in TRACE_HEADER_FIELDS])  # packed, as MDIO stores


def _file_dtype(fields: tuple[tuple[str, int, int], ...], endian: str, first_byte: int, size: int) -> np.dtype:
    """The fields where they lie in a ``size``-byte record that starts at byte ``first_byte``, in ``endian`` order."""
    order = ">" if endian == "big" else "<"
    return np.dtype({"names": [f[0] for f in fields], "formats": [f"{order}i{f[2]}" for f in fields],
                     "offsets": [f[1] - first_byte for f in fields], "itemsize": size})


def decode_trace_headers(raw: np.ndarray, endian: str) -> np.ndarray:
    """The rev-1 fields of trace headers ``raw`` [..., 240] uint8 (bytes in the file's ``endian`` order)
    as :data:`HEADER_DTYPE` [...]."""
    rows = np.ascontiguousarray(raw[..., :HEADER_BYTES]).view(_file_dtype(TRACE_HEADER_FIELDS, endian, 1, HEADER_BYTES))
    return rows[..., 0].astype(HEADER_DTYPE)


def decode_binary_header(head: bytes, endian: str, revision: str, samples: int) -> dict[str, int]:
    """The binary header of the file whose first 3600 bytes are ``head``, in the ``segy`` library's rev-1 names.
    ``revision`` ("major.minor", as :func:`sfm.formats.segy.read_layout` read it) and ``samples`` (the trace
    length, which MDIO's export takes from samples_per_trace; rev-2 files may hold it at byte 3269 only)
    are the layout's."""
    binary = np.frombuffer(head[3200:3600], dtype=_file_dtype(BINARY_HEADER_FIELDS, endian, 3201, 400))[0]
    fields = {name: int(binary[name]) for name, _, _ in BINARY_HEADER_FIELDS}
    if not 0 < samples < 1 << 15:
        raise SFMError(f"{samples} samples per trace do not fit the rev-1 binary header MDIO exports (at most "
                       "32767); ingest with --layout sfm")
    fields["samples_per_trace"] = int(samples)
    major, _, minor = revision.partition(".")
    return {**fields, "segy_revision_major": int(major), "segy_revision_minor": int(minor or 0)}


def text_header_lines(raw: bytes, encoding: str) -> str:
    """The 3200-byte textual header ``raw`` as MDIO keeps it and writes it back: 40 lines of 80 characters
    joined by newlines, EBCDIC (``encoding``, as :func:`sfm.formats.segy.decode_text_header` found it)
    decoded by the table MDIO's export encodes with (:data:`_EBCDIC_TO_ASCII`), so that every byte with an
    ASCII character there is written back as it was; the others become spaces."""
    data = raw[:3200].ljust(3200, b" ")
    if encoding == "ebcdic":
        data = data.translate(_EBCDIC_TO_ASCII)
    text = "".join(chr(b) if 32 <= b < 127 else " " for b in data)
    return "\n".join(text[i : i + 80] for i in range(0, 3200, 80))


def file_header_attributes(head: bytes, layout, encoding: str) -> dict[str, Any]:
    """``segy_file_header``'s attributes: ``textHeader`` and ``binaryHeader`` of the file whose first 3600
    bytes are ``head`` (``layout``: its :class:`sfm.formats.segy.SegyLayout`; ``encoding``: its text's)."""
    return {"textHeader": text_header_lines(head, encoding),
            "binaryHeader": decode_binary_header(head, layout.endian, layout.revision, layout.samples)}


def root_attributes(attrs: dict[str, Any], domain: str) -> dict[str, Any]:
    """The root attributes of an MDIO-layout store: sfm's ``attrs`` plus MDIO's. MDIO's ``name`` is the
    template's, so the survey's own name is kept as ``survey_name``."""
    mdio = {"apiVersion": MDIO_VERSION, "name": TEMPLATES[domain],
            "attributes": {"surveyType": "3D", "gatherType": "stacked", "defaultVariableName": "amplitude"}}
    return {**attrs, "survey_name": attrs["name"], **mdio}


def stats_v1(count: int, mean: float, m2: float, low: float, high: float) -> str:
    """MDIO's ``statsV1`` (a JSON string) of ``count`` live samples with this mean, sum of squared deviations
    ``m2``, min and max (all zeros when there are none); no histogram."""
    total = mean * count
    stats = {"count": int(count), "sum": float(total), "sumSquares": float(m2 + mean * total),
             "min": float(low) if count else 0.0, "max": float(high) if count else 0.0,
             "histogram": {"counts": [], "binCenters": []}}
    return json.dumps(stats, separators=(",", ":"))


def sample_coordinate(domain: str, start_ms: float, interval_us: int, samples: int) -> tuple[np.ndarray, dict]:
    """The sample axis of an MDIO-layout store [NS] and its attributes: ms (time) or m (depth, the interval
    read as mm, as MDIO reads it), int32 as MDIO writes it when every value is whole, else float64."""
    values = start_ms + np.arange(samples) * (interval_us / 1000.0)
    if np.all(values == np.rint(values)) and np.abs(values).max(initial=0) < 2**31:
        values = values.astype(np.int32)
    units = {"time": "ms", "depth": "m"}[domain]
    return values, {"units": units, "long_name": f"{domain}: delay (trace bytes 109-110) + index * interval"}



def create_arrays(group, layout, bricks: tuple[int, int, int]) -> None:
    """MDIO's ``segy_file_header`` and ``headers`` in ``group`` (a :class:`sfm.formats.zarr_writer.GroupWriter`):
    metadata only; the header chunks come with the traces (:func:`write_headers`), one per brick column."""
    import warnings

    from zarr.codecs import BloscCodec, ZstdCodec
    from zarr.errors import UnstableSpecificationWarning

    from sfm.formats.segy import decode_text_header
    from sfm.storage.ranged_file import open_ranged

    with open_ranged(layout.path) as source:
        head = source.read(0, 3600)
    _, encoding = decode_text_header(head[:3200])
    shape = (int(bricks[0]), int(bricks[1]))
    with warnings.catch_warnings():  # structured and fixed-length UTF-32 types have no Zarr v3 spec yet; MDIO uses them
        warnings.simplefilter("ignore", category=UnstableSpecificationWarning)
        group.create_array("segy_file_header", shape=(), dtype=np.dtype("<U1"), fill_value="",
                           compressors=ZstdCodec(level=0), attributes=file_header_attributes(head, layout, encoding))
        group.create_array("headers", shape=group.root["trace_mask"].shape, chunks=shape, dtype=HEADER_DTYPE,
                           compressors=BloscCodec(**HEADER_CODEC), dimension_names=["inline", "crossline"],
                           attributes={"coordinates": "cdp_x cdp_y"})


def write_headers(group, origin: tuple[int, int], raw: np.ndarray, live: np.ndarray, endian: str) -> None:
    """Store the header chunk at ``origin`` (inline, crossline indices of its first cell): trace headers
    ``raw`` [a, b, 240] uint8 of the cells ``live`` [a, b] (holes: zeros)."""
    values = decode_trace_headers(raw, endian)
    values[~live] = np.zeros((), HEADER_DTYPE)
    group.write_chunk("headers", origin, values)


# ---- back to SEG-Y (sfm.predict.segy_export): the inverse of the decoding above ----------------------


def encode_trace_headers(values: np.ndarray, endian: str) -> np.ndarray:
    """Trace headers [..., 240] uint8 in ``endian`` byte order from rev-1 fields ``values`` (:data:`HEADER_DTYPE`
    [...]); the inverse of :func:`decode_trace_headers` (bytes 233-240, which are not kept, are 0)."""
    rows = np.zeros(values.shape, _file_dtype(TRACE_HEADER_FIELDS, endian, 1, HEADER_BYTES))
    for name, _, _ in TRACE_HEADER_FIELDS:
        rows[name] = values[name]
    return np.frombuffer(rows.tobytes(), dtype=np.uint8).reshape(*values.shape, HEADER_BYTES)


def encode_file_header(attributes: dict[str, Any], endian: str, sample_format: int) -> bytes:
    """The 3600-byte file header of ``segy_file_header``'s ``attributes`` (:func:`file_header_attributes`): the
    textual header in EBCDIC (as MDIO's export writes it) and the binary header in ``endian`` order, with
    ``sample_format`` as its data sample format code."""
    lines = str(attributes.get("textHeader", "")).split("\n")
    text = "".join(line[:80].ljust(80) for line in lines)[:3200].ljust(3200).encode("ascii", "replace")
    to_ebcdic = bytearray(256)
    for code, ascii_code in enumerate(_EBCDIC_TO_ASCII):
        to_ebcdic[ascii_code] = code
    fields = {**attributes.get("binaryHeader", {}), "data_sample_format": int(sample_format)}
    binary = np.zeros(1, _file_dtype(BINARY_HEADER_FIELDS, endian, 3201, 400))
    for name, _, _ in BINARY_HEADER_FIELDS:
        binary[name] = int(fields.get(name, 0))
    raw = bytearray(binary.tobytes())
    raw[300:302] = bytes([int(fields.get("segy_revision_major", 1)), int(fields.get("segy_revision_minor", 0))])
    return text.translate(bytes(to_ebcdic)) + bytes(raw)
