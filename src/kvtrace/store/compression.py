"""Column compression of the keyed tables, chosen once per database from the first rows it stores.

DuckDB compresses each column segment with whichever of its methods it estimates smallest, and to
estimate, it runs every candidate's analysis over the segment's values: for the integer columns of the
keyed tables, run-length (RLE) and bit packing. That analysis is about a quarter of the CPU an ingest
spends in DuckDB (docs/performance.md). A column declared `USING COMPRESSION <method>` skips it.

The right method depends on the data: `kv_access.ts_ns` is constant over a layer's accesses in one
recording (RLE, 0.2 B a value) and varies per record in another (bit packing; RLE would take 10 B a
value). So the choice is made from the data, as DuckDB would make it: the first chunk a keyed table
gets in a database (at least a row group; smaller tables keep DuckDB's own choice per segment) is
measured with the same size estimates DuckDB uses (`choose`), and the still empty table is made again
with the winner of each column. DuckDB keeps the declaration in the database, so later sessions use it
too: a database that mixes very different recordings can end up larger than with DuckDB's choice per
segment, never wrong.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

GROUP = 2048  # values per bit-packing group (DuckDB's BITPACKING_METADATA_GROUP_SIZE)
GROUP_HEADER_BYTES = 4  # DuckDB's metadata per bit-packing group
RLE_COUNT_BYTES = 2  # DuckDB's run length (uint16) stored with each run's value
ROW_GROUP = 122_880  # DuckDB's row group
MIN_ROWS = ROW_GROUP  # fewer rows than this say little about the table: keep DuckDB's own choice
SAMPLE_ROWS = ROW_GROUP  # as many as DuckDB decides for at once (a row group's segment)


def choose(data: pa.Table) -> dict[str, str]:
    """{column: "rle" or "bitpacking"} for the integer columns of `data` (the rows as they will be
    stored), by DuckDB's size estimates over the first `SAMPLE_ROWS` rows; {} below `MIN_ROWS` rows.
    Columns with no valid value, or not integers, are left out (DuckDB chooses)."""
    if data.num_rows < MIN_ROWS:
        return {}
    data = data.slice(0, SAMPLE_ROWS)
    choice = {}
    for name, column in zip(data.column_names, data.columns):
        if not pa.types.is_integer(column.type):
            continue
        sizes = estimated_bytes(column)
        if sizes is not None:
            rle, bitpacking = sizes
            choice[name] = "rle" if rle < bitpacking else "bitpacking"
    return choice


def estimated_bytes(column: pa.ChunkedArray | pa.Array) -> tuple[float, float] | None:
    """(RLE bytes, bit-packing bytes) DuckDB would estimate for these integer values; None if all null.

    RLE: one value and a count per run. Bit packing: per group of 2048 values the cheapest of DuckDB's
    modes (constant, constant delta, frame of reference, delta frame of reference), each with its
    header. Nulls count as the value before them (they neither break a run nor widen a group)."""
    if column.null_count:
        column = pc.fill_null_backward(pc.fill_null_forward(column))
        if column.null_count:
            return None
    width = column.type.bit_width // 8
    values = np.asarray(column.to_numpy(), np.int64)
    n = len(values)
    if n < 2:
        return None
    runs = 1 + int(np.count_nonzero(values[1:] != values[:-1]))
    rle = runs * (width + RLE_COUNT_BYTES)
    groups = values[: n - n % GROUP].reshape(-1, GROUP)
    if not len(groups):
        return None
    lo, hi = groups.min(axis=1), groups.max(axis=1)
    deltas = np.diff(groups, axis=1)
    dlo, dhi = deltas.min(axis=1), deltas.max(axis=1)
    packed_for = width + 1 + GROUP * _bits(hi - lo) / 8  # frame, bit width, values
    packed_delta = 2 * width + 1 + GROUP * _bits(dhi - dlo) / 8  # frame, first value, bit width, deltas
    per_group = np.where(lo == hi, width, np.where(dlo == dhi, 2 * width, np.minimum(packed_for, packed_delta)))
    bitpacking = (per_group + GROUP_HEADER_BYTES).sum() * n / (len(groups) * GROUP)
    return float(rle), float(bitpacking)


def _bits(spread: np.ndarray) -> np.ndarray:
    """Bits needed for each value of `spread` (non-negative; a difference of int64 may wrap: 64)."""
    spread = spread.astype(np.uint64)
    bits = np.zeros(len(spread), np.int64)
    positive = spread > 0
    bits[positive] = np.floor(np.log2(spread[positive].astype(np.float64))).astype(np.int64) + 1
    return np.minimum(bits, 64)


def column_clause(method: str | None) -> str:
    return f" USING COMPRESSION {method}" if method else ""
