"""A loaded model directory: raw rows in, click probabilities out, preprocessed exactly as in training."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recscale.data.preprocess import encode
from recscale.data.readers.base import unweighted
from recscale.data.schema import LABEL
from recscale.data.sources import open_split
from recscale.serve.artifact import WEIGHTS, read_artifact
from recscale.serve.export import inference_model, load_weights
from recscale.serve.rows import RowParser
from recscale.train.precision import Precision, autocast

DEFAULT_MAX_ROWS = 4096


class Scorer:
    """``Scorer(model_dir).probabilities(parser.parse(body))``: (B,) float32 in request row order."""

    def __init__(self, model_dir: Path, max_rows: int = DEFAULT_MAX_ROWS) -> None:
        art = read_artifact(model_dir)
        self.manifest, self.config, self.pre = art.manifest, art.config, art.pre
        self.model = inference_model(art.config, art.pre, art.manifest.tables)
        load_weights(self.model, art.tensors, art.manifest.tables, str(Path(model_dir) / WEIGHTS))
        # The dense network computes as the run's own evaluation did (a bf16 run under bf16 autocast, so an
        # fp32 export scores exactly as `recscale eval`), and under bf16 autocast for bf16 weights.
        bf16 = art.manifest.dense == "bf16" or art.config.train.precision == "bf16"
        self.precision: Precision = "bf16" if bf16 else "fp32"
        self.parser = RowParser(art.pre.schema, max_rows)
        art.pre.index_vocabularies()  # now, not by the first request
        self._keys = art.pre.schema.sparse_names
        self._weighted = any(f.weighted for f in art.pre.schema.sparse)

    @torch.inference_mode()
    def logits(self, batch: pa.RecordBatch) -> torch.Tensor:
        """Raw-layout rows (B) -> logits (B,) float32. The batch holds the columns of ``parser.arrow_schema``
        (``parser.parse`` makes one from a JSON request); one lacking a column is a ``DataError``."""
        dense, values, lengths, weights = (torch.from_numpy(a) for a in encode(batch, self.pre))
        kjt = KeyedJaggedTensor(
            keys=self._keys, values=values, lengths=lengths, weights=weights if self._weighted else None
        )
        with autocast(self.precision, dense.device):
            return self.model(dense, kjt).float()

    def probabilities(self, batch: pa.RecordBatch) -> np.ndarray:
        return torch.sigmoid(self.logits(batch)).numpy()

    def score_file(self, path: Path, chunk_rows: int = 8192) -> tuple[np.ndarray, np.ndarray]:
        """(logits (N,), labels (N,)) of a data file in the run's format, read by the run's reader as
        ``recscale eval`` reads it (MovieLens: its test split, not the training split its options name).

        Each chunk's logits and labels are copied into two arrays grown by doubling, not kept to be joined at
        the end: kept, every chunk's small output pinned the allocator's heap between the chunks' freed
        temporaries (as ``predict``'s once did), and a 3M-row file held ~1 GB for 12 MB of scores."""
        data = self.config.data
        logits, labels, n = np.empty(0, np.float32), np.empty(0, np.float32), 0
        schema = unweighted(self.pre.schema)  # no row-weight column needed: scores do not depend on it
        batches = open_split(
            data.format, str(path), "test", schema, data.options or {}, chunk_rows=chunk_rows
        )
        for batch in batches:
            rows = batch.num_rows
            if n + rows > len(logits):
                size = max(2 * len(logits), n + rows)
                logits, labels = np.resize(logits, size), np.resize(labels, size)
            logits[n : n + rows] = self.logits(batch).numpy()
            labels[n : n + rows] = batch.column(LABEL).to_numpy(zero_copy_only=False)
            n += rows
        return logits[:n].copy(), labels[:n].copy()
