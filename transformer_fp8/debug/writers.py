"""Where the statistics go: JSON lines (always available) and TensorBoard scalars (asked for
with tensorboard_dir=; they need the tensorboard package)."""
from __future__ import annotations

import json
import math
from typing import Optional


def _json_value(v):
    # JSON has no inf / nan: written as strings, read back by read_records.
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class JsonLinesWriter:
    """One JSON object per line: step, layer, gemm, tensor and the figures of stats.derive.
    The file is emptied when the writer is made (a new collector: a new run; runs appended to
    one file could not be told apart), then appended to (the same collector enabled again
    goes on in it)."""

    def __init__(self, path: str):
        self.path = path
        open(path, "w", encoding="utf-8").close()  # emptied once, by this writer
        self._file = open(path, "a", encoding="utf-8")

    def write(self, records: list) -> None:
        if self._file.closed:  # (closed by the collector's disable(), enabled again since)
            self._file = open(self.path, "a", encoding="utf-8")
        for record in records:
            self._file.write(json.dumps({k: _json_value(v) for k, v in record.items()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


_NAME_FIELDS = ("layer", "gemm", "tensor")  # (strings as written: a layer may be named "inf")


def read_records(path: str) -> list:
    """The records of a JSON lines file written by JsonLinesWriter (inf / nan restored)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                out.append({k: float(v) if k not in _NAME_FIELDS and v in ("inf", "-inf", "nan")
                            else v for k, v in record.items()})
    return out


SCALARS = ("amax", "scale_min", "underflow_frac", "saturation_frac", "dynamic_range_log2",
           "sqnr_db", "block_min_sqnr_db")


class TensorBoardWriter:
    """Scalars fp8/<layer>[.<gemm>]/<tensor>/<figure> per logged step, non-finite ones too (a
    NaN amax, an infinite dynamic range: TensorBoard takes NaN and inf scalars)."""

    def __init__(self, summary_writer):
        self._writer = summary_writer

    @classmethod
    def create(cls, log_dir: Optional[str]) -> Optional["TensorBoardWriter"]:
        if log_dir is None:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(f"tensorboard_dir={log_dir!r} needs the tensorboard package, "
                              "which is not installed (pip install tensorboard)") from e
        return cls(SummaryWriter(log_dir))

    def write(self, records: list) -> None:
        for r in records:
            label = r["layer"] + (f".{r['gemm']}" if r["gemm"] else "")
            for figure in SCALARS:
                self._writer.add_scalar(f"fp8/{label}/{r['tensor']}/{figure}", r[figure],
                                        r["step"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
