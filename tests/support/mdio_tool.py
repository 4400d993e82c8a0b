"""Run by the separate MDIO environment's python (tests/support/mdio_env.py), never imported by sfm's tests.

    python mdio_tool.py from-segy SRC.sgy DST.mdio [--domain time|depth] [--chunks 16,16,32]
    python mdio_tool.py to-segy SRC.mdio DST.sgy [--sample-format spec|store]
    python mdio_tool.py describe SRC.mdio        # one JSON line: what MDIO's own reader sees

It uses only multidimio's public API (``segy_to_mdio``, ``mdio_to_segy``, ``open_mdio``) with the SEG-Y
rev 1 standard spec, as a user of MDIO would.
"""

from __future__ import annotations

import argparse
import json


def _spec():
    from segy.standards import get_segy_standard

    return get_segy_standard(1.0)


def from_segy(args) -> None:
    import mdio
    from mdio.builder.template_registry import TemplateRegistry

    template = TemplateRegistry().get(f"PostStack3D{args.domain.capitalize()}")
    if args.chunks:
        template.full_chunk_shape = tuple(int(c) for c in args.chunks.split(","))
    mdio.segy_to_mdio(_spec(), template, args.src, args.dst, overwrite=True)


# SEG-Y sample format code -> the segy library's sample type (what --sample-format store exports in)
SAMPLE_TYPES = {1: "IBM32", 2: "INT32", 3: "INT16", 5: "FLOAT32", 6: "FLOAT64", 8: "INT8", 9: "INT64",
                10: "UINT32", 11: "UINT16", 12: "UINT64", 16: "UINT8"}


def to_segy(args) -> None:
    """The rev 1 spec exports IBM floats, whatever data_sample_format the store's binary header (written into
    the file) says; ``--sample-format store`` exports in that format instead, as a user exporting a non-IBM
    survey must tell MDIO to."""
    import mdio
    from segy.schema import ScalarType

    spec = _spec()
    if args.sample_format == "store":
        code = mdio.open_mdio(args.src)["segy_file_header"].attrs["binaryHeader"]["data_sample_format"]
        spec.trace.data.format = ScalarType[SAMPLE_TYPES[int(code)]]
    mdio.mdio_to_segy(spec, args.src, args.dst)


def describe(args) -> None:
    import numpy as np
    import mdio

    ds = mdio.open_mdio(args.src)
    name = ds.attrs["attributes"]["defaultVariableName"]
    amp = ds[name]
    mask = ds["trace_mask"].values
    values = amp.values
    out = {
        "dims": list(amp.dims), "shape": list(amp.shape), "dtype": str(amp.dtype),
        "attrs": {k: v for k, v in ds.attrs.items() if k != "createdOn"},
        "variables": sorted(ds.variables), "live_traces": int(mask.sum()),
        "live_sum": float(np.nansum(values[mask].astype(np.float64))),
        "stats": json.loads(amp.attrs["statsV1"]) if "statsV1" in amp.attrs else None,
        "coords": {d: ds[d].values.tolist() for d in amp.dims},
        "has_file_header": "segy_file_header" in ds.variables,
    }
    print("MDIO-JSON " + json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("from-segy")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--domain", default="time", choices=("time", "depth"))
    p.add_argument("--chunks", default="")
    p.set_defaults(run=from_segy)
    p = sub.add_parser("to-segy")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--sample-format", default="spec", choices=("spec", "store"))
    p.set_defaults(run=to_segy)
    p = sub.add_parser("describe")
    p.add_argument("src")
    p.set_defaults(run=describe)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":  # MDIO's converters start worker processes by spawn: they re-import this file
    main()
