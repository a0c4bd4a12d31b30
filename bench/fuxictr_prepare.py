"""FuxiCTR's own preprocessing of a Criteo-shaped CSV (label, I1..I13, C1..C26), timed; prints one JSON line.

Run with FuxiCTR's interpreter, never recscale's (bench/pipeline.py --fuxictr-venv does this):

    PYTHONPATH=../shared/peers/fuxictr/src /tmp/fuxictr-venv/bin/python bench/fuxictr_prepare.py FILE.csv ROWS

It runs FuxiCTR's ``build_dataset`` on the file as its Criteo configs do (numeric I1..I13 with missing
values filled, categorical C1..C26 with min count 1): read with polars, fit the vocabularies, transform
and write the parquet split. Only FuxiCTR's public API is called.
"""

import json
import sys
import tempfile
import time

USAGE = "usage: fuxictr_prepare.py FILE.csv ROWS  (with FuxiCTR's interpreter)"


def main() -> None:
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(f"{USAGE}\n{__doc__}")
        return
    if len(sys.argv) != 3 or not sys.argv[2].isdecimal():
        raise SystemExit(USAGE)
    path, rows = sys.argv[1], int(sys.argv[2])
    # Imported here, so that --help answers under any interpreter (FuxiCTR's alone has fuxictr).
    from fuxictr.preprocess import FeatureProcessor, build_dataset

    features = [
        {
            "name": [f"I{i}" for i in range(1, 14)],
            "active": True,
            "dtype": "float",
            "type": "numeric",
            "fill_na": 0,
        },
        {"name": [f"C{i}" for i in range(1, 27)], "active": True, "dtype": "str", "type": "categorical"},
    ]
    with tempfile.TemporaryDirectory(prefix="fuxictr-prep-") as root:
        t0 = time.perf_counter()
        encoder = FeatureProcessor(
            feature_cols=features,
            label_col={"name": "label", "dtype": "float"},
            dataset_id="bench",
            data_root=root,
        )
        build_dataset(encoder, train_data=path, data_format="csv", min_categr_count=1)
        seconds = time.perf_counter() - t0
    print(json.dumps({"fuxictr_prepare_rows_per_s": round(rows / seconds), "seconds": round(seconds, 2)}))


if __name__ == "__main__":
    main()
