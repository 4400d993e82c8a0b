"""``sfm synth``, ``sfm ingest``, ``sfm ingest-labels``: SEG-Y (or MDIO, or labels) in, published stores out."""

from __future__ import annotations

import argparse
import json
import sys

from sfm.cli.options import OldSpelling
from sfm.config import DATA_ROOT, DOMAINS, INGEST_DTYPES, LAYOUTS, IngestConfig
from sfm.errors import SFMError


def _cmd_synth(args: argparse.Namespace) -> None:
    from sfm.synth.survey import synth_survey

    result = synth_survey(
        args.out,
        shape=tuple(args.shape),
        seed=args.seed,
        sample_format=args.format,
        endian=args.endian,
        iline_byte=args.iline_byte,
        xline_byte=args.xline_byte,
        sorting=args.sorting,
    )
    print(json.dumps(result))


def _cmd_ingest(args: argparse.Namespace) -> None:
    """One JSON line per survey on stdout, one summary line on stderr; each bad file gets its own error line."""
    import time

    from sfm.ingest.survey import ingest_survey

    IngestConfig(layout=args.layout, domain=args.domain).check_layout()  # once, before any file
    t0, read_bytes, failures = time.perf_counter(), 0, []
    for src in args.src:
        try:
            row = ingest_survey(src, args.data_root, iline_byte=args.iline_byte, xline_byte=args.xline_byte,
                                endian=args.endian, chunk=args.chunk, dtype=args.dtype, codec=args.codec,
                                max_sparsity=args.max_sparsity, layout=args.layout, domain=args.domain,
                                nonfinite="refuse" if args.refuse_nonfinite else "replace",
                                progress=True)
        except SFMError as err:
            if len(args.src) == 1:
                raise
            failures.append(src)
            print(f"sfm ingest: error: {err}", file=sys.stderr, flush=True)
            continue
        if row["status"] == "ingested":
            read_bytes += json.loads(row["stats_json"])["count"] * 4
        stats = json.loads(row.pop("stats_json"))
        print(json.dumps({**row, "stats": stats}, default=str), flush=True)
    seconds = time.perf_counter() - t0
    done = len(args.src) - len(failures)
    print(f"sfm ingest: {done} of {len(args.src)} survey(s) in {seconds:.1f}s, {read_bytes / 1e6:.1f} MB of samples "
          f"ingested ({read_bytes / 1e6 / max(seconds, 1e-9):.1f} MB/s)", file=sys.stderr)
    if failures:
        raise SFMError(f"{len(failures)} of {len(args.src)} sources failed (see the lines above): {', '.join(failures)}")


def _cmd_ingest_labels(args: argparse.Namespace) -> None:
    """One JSON line: the label set's manifest row and whether it was ingested or existed."""
    from sfm.ingest.labels import ingest_labels

    row = ingest_labels(args.labels, args.survey, args.data_root, ignore=args.ignore, variable=args.variable,
                        name=args.name)
    row.pop("label_mask")
    print(json.dumps(row, default=str))
    print(f"sfm ingest-labels: {row['name']} -> {row['store_url']} ({row['status']}): {row['labelled_voxels']} "
          f"labelled voxels on {row['labelled_inlines']} inlines, classes {row['classes']}, {row['seconds']:.1f}s",
          file=sys.stderr)


def add_commands(sub) -> None:
    """synth, ingest, ingest-labels: SEG-Y in, survey stores out."""
    p = sub.add_parser("synth", help="write a synthetic post-stack SEG-Y survey and its fault labels")
    p.add_argument("out", help="output SEG-Y path (fault labels are written beside it)")
    p.add_argument("--shape", type=int, nargs=3, metavar=("IL", "XL", "NS"), default=[64, 64, 128])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", type=int, choices=[1, 3, 5, 8], default=5, help="SEG-Y sample format code")
    p.add_argument("--endian", choices=["big", "little"], default="big")
    p.add_argument("--iline-byte", type=int, default=189)
    p.add_argument("--xline-byte", type=int, default=193)
    p.add_argument("--sorting", choices=["inline", "crossline"], default="inline")
    p.set_defaults(func=_cmd_synth)

    p = sub.add_parser("ingest", help="SEG-Y files -> Zarr v3 survey stores, published in the manifest; MDIO v1 "
                       "stores are registered, read in place (nothing copied)")
    p.add_argument("src", nargs="+", help="SEG-Y files or MDIO v1 stores (.mdio; local paths or s3:// URLs)")
    p.add_argument("--data-root", default=DATA_ROOT, help=f"the data root the stores and the manifest go to (local "
                   f"path or s3://bucket/prefix; default {DATA_ROOT})")
    p.add_argument("--out", dest="data_root", action=OldSpelling, new="--data-root")
    p.add_argument("--iline-byte", type=int, default=None, help="trace-header byte of the inline number")
    p.add_argument("--xline-byte", type=int, default=None, help="trace-header byte of the crossline number")
    p.add_argument("--endian", choices=["auto", "big", "little"], default="auto")
    p.add_argument("--chunk", type=int, default=128, help="brick edge in voxels (default 128: 128^3 bricks)")
    p.add_argument("--dtype", choices=INGEST_DTYPES, default=IngestConfig.dtype,
                   help="float32 is lossless; float16 stores standardised values, int8 values quantised over the "
                        "0.1-99.9 percentile range (saturating beyond it); both record the transform")
    p.add_argument("--codec", default=IngestConfig.codec,
                   help=f"Blosc compressor of the bricks, cname[:clevel] (default {IngestConfig.codec}; lz4 decodes "
                        "about twice as fast and stores 5-25 %% more bytes)")
    p.add_argument("--max-sparsity", type=float, default=10.0,
                   help="largest allowed ratio of grid cells to traces (default 10)")
    p.add_argument("--refuse-nonfinite", action="store_true",
                   help="fail on NaN/inf samples instead of replacing them by 0 and counting them")
    p.add_argument("--layout", choices=LAYOUTS, default=IngestConfig.layout,
                   help="sfm (default), or mdio: also what MDIO's tools read and export")
    p.add_argument("--domain", choices=DOMAINS, default=IngestConfig.domain,
                   help="the sample axis, time (default) or depth: its name in the mdio layout")
    p.set_defaults(func=_cmd_ingest)

    p = sub.add_parser("ingest-labels", help="a label volume aligned with a published survey (SEG-Y with its "
                       "geometry, .npy on its grid, or a Zarr/MDIO integer variable) -> a label store in the manifest")
    p.add_argument("labels", help="the label file or store (local path or s3:// URL)")
    p.add_argument("--survey", required=True, help="the survey it labels: its survey id in --data-root, or its store "
                   "URL")
    p.add_argument("--data-root", default=DATA_ROOT, help=f"the data root holding the survey (default {DATA_ROOT})")
    p.add_argument("--out", dest="data_root", action=OldSpelling, new="--data-root")
    p.add_argument("--ignore", type=int, default=None, help="the value of samples nobody interpreted (255 always is)")
    p.add_argument("--variable", default="", help="Zarr/MDIO: the variable holding the labels (default: the only "
                   "integer 3-D one)")
    p.add_argument("--name", default="", help="display name (default: the file name)")
    p.set_defaults(func=_cmd_ingest_labels)
