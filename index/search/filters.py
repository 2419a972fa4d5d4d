"""Filtered search's index side: the fields declared filterable at build time, a query's filter
as plain dataclasses (serving converts the protocol's messages into these), and the value → rows
structure of a version (`filters.npz`) that turns a filter into the bool mask of its rows.

A field's structure is three arrays, whatever its type: `values` (its distinct values, sorted),
`offsets` (CSR: value i's rows are `rows[offsets[i]:offsets[i + 1]]`) and `rows` (grouped by
value, ascending within a value). Equality and set membership look values up by binary search;
a numeric range is the run of values between two binary searches, so its rows are one slice —
at a million items a filter costs a few array operations, never a Python object per row. A row
without a value for the field (absent, or an empty cell) is in no run: it matches no condition
on that field, and every `must_not` on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from core.data.items import ItemTable

FIELD_TYPES = ("string", "int", "float")
LABEL = "label"  # the items table's own label column, filterable like a metadata field


class FilterError(ValueError):
    """A filter that cannot be applied: names the field (serving answers INVALID_ARGUMENT)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"filter field {field_name!r}: {message}" if field_name else f"filter: {message}")
        self.field = field_name


@dataclass(frozen=True)
class FieldSpec:
    """A field declared filterable: a metadata column (or `label`) and the type of its values."""

    name: str
    type: str = "string"

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a filterable field needs a name")
        if self.type not in FIELD_TYPES:
            kinds = ", ".join(FIELD_TYPES)
            raise ValueError(f"filterable field {self.name!r}: type {self.type!r} is not one of {kinds}")

    @property
    def numeric(self) -> bool:
        return self.type != "string"

    def __str__(self) -> str:
        return f"{self.name}:{self.type}"

    def parse(self, text: str) -> str | int | float:
        """`text` as a value of this field; ValueError when it is not one."""
        if self.type == "string":
            return text
        if self.type == "int":
            return int(text.strip())  # "3.5" and "" are not ints
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"{text!r} is not a finite number")
        return value


def parse_filterable(declared: Iterable[str]) -> list[FieldSpec]:
    """`category`, `brand`, `price:float`, ... as field specs (string when no type is given);
    ValueError for an unknown type or a field declared twice."""
    specs: list[FieldSpec] = []
    for entry in declared:
        name, _, kind = entry.strip().partition(":")
        spec = FieldSpec(name.strip(), kind.strip() or "string")
        if any(s.name == spec.name for s in specs):
            raise ValueError(f"filterable field {spec.name!r} is declared twice")
        specs.append(spec)
    return specs


def column_values(name: str, labels: Sequence[str | None], metadata: Iterable[dict[str, str]]) -> Iterator[str | None]:
    """Row by row, the text of column `name` (`label` or a metadata key); None where a row has none."""
    if name == LABEL:
        yield from labels
    else:
        for meta in metadata:
            yield meta.get(name)


def check_catalog_fields(
    specs: Sequence[FieldSpec],
    labels: Sequence[str] | None,
    metadata: list[dict[str, str]],
    flag: str = "--filterable",
) -> None:
    """Every declared field is a column of the catalog, and every value of a numeric one parses:
    ValueError naming the column (and the first bad row, counted from 1) otherwise, and the
    `flag` that declared it."""
    for spec in specs:
        if spec.name == LABEL:
            if labels is None:
                raise ValueError(f"{flag} {LABEL}: the catalog has no {LABEL} column")
        elif not any(spec.name in meta for meta in metadata):
            raise ValueError(f"{flag} {spec.name}: the catalog has no column {spec.name!r}")
        _parsed(spec, column_values(spec.name, labels or [], metadata))


def _parsed(spec: FieldSpec, texts: Iterable[str | None]) -> tuple[list[int], list]:
    """(rows with a value, their parsed values); ValueError naming the column and first bad row."""
    rows, values = [], []
    for row, text in enumerate(texts):
        if text is None or text == "":
            continue
        try:
            values.append(spec.parse(text))
        except ValueError:
            raise ValueError(
                f"--filterable {spec}: column {spec.name!r} row {row + 1} holds {text!r}, not a {spec.type}"
            ) from None
        rows.append(row)
    return rows, values


# -- a query's filter -----------------------------------------------------------------------


@dataclass(frozen=True)
class Range:
    """Numeric bounds, each optional: at least one, at most one lower and one upper."""

    gte: float | None = None
    gt: float | None = None
    lte: float | None = None
    lt: float | None = None


@dataclass(frozen=True)
class Condition:
    """One test on one field: equality (`value`), membership (`any_of`) or a numeric `range`;
    exactly one of the three."""

    field: str
    value: str | None = None
    any_of: tuple[str, ...] | None = None
    range: Range | None = None


@dataclass(frozen=True)
class Filter:
    """Rows meeting every `must`, at least one `should` (when any is given) and no `must_not`."""

    must: tuple[Condition, ...] = ()
    should: tuple[Condition, ...] = ()
    must_not: tuple[Condition, ...] = ()

    @property
    def conditions(self) -> tuple[Condition, ...]:
        return self.must + self.should + self.must_not


# -- the value → rows structure -------------------------------------------------------------


@dataclass
class FieldRows:
    """One field's value → rows structure (see the module docstring)."""

    spec: FieldSpec
    values: np.ndarray  # distinct values, sorted: str (numpy unicode), int64 or float64
    offsets: np.ndarray  # int64, len(values) + 1
    rows: np.ndarray  # int32 or int64 row numbers grouped by value

    @classmethod
    def build(cls, spec: FieldSpec, texts: Iterable[str | None], n: int) -> FieldRows:
        rows, parsed = _parsed(spec, texts)
        dtype = {"string": np.str_, "int": np.int64, "float": np.float64}[spec.type]
        values = np.asarray(parsed, dtype=dtype) if parsed else np.zeros(0, dtype=dtype)
        order = np.argsort(values, kind="stable")  # stable: rows stay ascending within a value
        row_type = np.int32 if n < 2**31 else np.int64
        sorted_values = values[order]
        distinct, starts = np.unique(sorted_values, return_index=True)
        offsets = np.append(starts, len(sorted_values)).astype(np.int64)
        return cls(spec, distinct, offsets, np.asarray(rows, dtype=np.int64)[order].astype(row_type))

    def _run(self, lo: int, hi: int) -> np.ndarray:
        """Rows of distinct values lo..hi-1."""
        return self.rows[self.offsets[lo] : self.offsets[max(lo, hi)]]

    def rows_equal(self, value: str | int | float) -> np.ndarray:
        i = int(np.searchsorted(self.values, value, side="left"))
        if i < len(self.values) and self.values[i] == value:
            return self._run(i, i + 1)
        return self.rows[:0]

    def rows_in(self, bounds: Range) -> np.ndarray:
        lo, hi = 0, len(self.values)
        if bounds.gte is not None:
            lo = int(np.searchsorted(self.values, bounds.gte, side="left"))
        if bounds.gt is not None:
            lo = int(np.searchsorted(self.values, bounds.gt, side="right"))
        if bounds.lte is not None:
            hi = int(np.searchsorted(self.values, bounds.lte, side="right"))
        if bounds.lt is not None:
            hi = int(np.searchsorted(self.values, bounds.lt, side="left"))
        return self._run(lo, hi)


@dataclass
class FilterIndex:
    """Every filterable field of a version: `mask(filter)` is the bool mask of its rows."""

    size: int  # rows of the version
    fields: dict[str, FieldRows] = field(default_factory=dict)

    @property
    def specs(self) -> list[FieldSpec]:
        return [f.spec for f in self.fields.values()]

    @classmethod
    def build(cls, items: ItemTable, specs: Sequence[FieldSpec]) -> FilterIndex:
        """The structure of `items`' declared fields. The metadata JSON is parsed once for all
        fields; ValueError names a column whose value does not parse as its type."""
        n = len(items)
        metadata = list(items.metadata) if any(s.name != LABEL for s in specs) else []
        built = cls(n)
        for spec in specs:
            if spec.name == LABEL and not items.labelled:
                raise ValueError(f"--filterable {LABEL}: the items have no labels")
            built.fields[spec.name] = FieldRows.build(spec, column_values(spec.name, items.labels, metadata), n)
        return built

    @classmethod
    def concat(cls, parts: Sequence[FilterIndex], offsets: Sequence[int], size: int) -> FilterIndex:
        """One structure over `size` rows from the structures of consecutive row ranges (a
        sharded version's shards: part i's row r is row `offsets[i] + r`)."""
        merged = cls(size)
        for name, first in parts[0].fields.items() if parts else ():
            values = np.concatenate([np.repeat(p.fields[name].values, np.diff(p.fields[name].offsets)) for p in parts])
            rows = np.concatenate(
                [p.fields[name].rows.astype(np.int64) + offset for p, offset in zip(parts, offsets, strict=True)]
            )
            order = np.lexsort((rows, values))  # by value, rows ascending within a value
            distinct, starts = np.unique(values[order], return_index=True)
            offsets_of = np.append(starts, len(order)).astype(np.int64)
            row_type = np.int32 if size < 2**31 else np.int64
            merged.fields[name] = FieldRows(first.spec, distinct, offsets_of, rows[order].astype(row_type))
        return merged

    # -- file ---------------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        arrays: dict[str, np.ndarray] = {
            "size": np.asarray(self.size, dtype=np.int64),
            "fields": np.asarray([str(f.spec) for f in self.fields.values()], dtype=np.str_),
        }
        for i, f in enumerate(self.fields.values()):
            arrays[f"{i}.values"], arrays[f"{i}.offsets"], arrays[f"{i}.rows"] = f.values, f.offsets, f.rows
        with open(path, "wb") as out:  # an open file: np.savez would append .npz to a name without it
            np.savez(out, **arrays)

    @classmethod
    def load(cls, path: str | Path) -> FilterIndex:
        with np.load(path, allow_pickle=False) as data:
            loaded = cls(int(data["size"]))
            for i, spec in enumerate(parse_filterable(str(s) for s in data["fields"])):
                f = FieldRows(spec, data[f"{i}.values"], data[f"{i}.offsets"], data[f"{i}.rows"])
                if len(f.offsets) != len(f.values) + 1 or (len(f.rows) and int(f.rows.max()) >= loaded.size):
                    raise ValueError(f"field {spec.name!r}: offsets or rows do not fit {loaded.size} rows")
                loaded.fields[spec.name] = f
        return loaded

    # -- queries ------------------------------------------------------------------------------

    def mask(self, query: Filter) -> np.ndarray:
        """A bool per row: True where the row meets `query`. FilterError names the field of a
        condition that is empty, contradictory, of the wrong type or on an undeclared field."""
        check_filter(query, [f.spec for f in self.fields.values()])
        rows = [[self._rows_meeting(c) for c in group] for group in (query.must, query.should, query.must_not)]
        must, should, must_not = rows
        if must:
            counts = np.zeros(self.size, dtype=np.int32)
            for r in must:
                counts[r] += 1  # rows of one condition are distinct: a row meets all when counted len(must) times
            allowed = counts == len(must)
        else:
            allowed = np.ones(self.size, dtype=bool)
        if should:
            any_should = np.zeros(self.size, dtype=bool)
            for r in should:
                any_should[r] = True
            allowed &= any_should
        for r in must_not:
            allowed[r] = False
        return allowed

    def _rows_meeting(self, condition: Condition) -> np.ndarray:
        """The rows meeting one condition (distinct); checked already (`check_filter`)."""
        rows = self.fields[condition.field]
        if condition.value is not None:
            return rows.rows_equal(_value(rows.spec, condition.value))
        if condition.any_of is not None:
            values = sorted({_value(rows.spec, v) for v in condition.any_of})
            return np.concatenate([rows.rows_equal(v) for v in values])
        return rows.rows_in(condition.range)


def check_filter(query: Filter, specs: Sequence[FieldSpec]) -> None:
    """FilterError unless `query` can be applied to rows declaring the fields `specs`: it has a
    condition, and each one names a declared field and one match of its type (`check_condition`).
    Needs no rows: what a sharded server's ingress checks before its shards make the masks."""
    if not query.conditions:
        raise FilterError("", "has no conditions (give must, should or must_not)")
    for group in (query.must, query.should, query.must_not):
        for condition in group:
            check_condition(condition, specs)


def check_condition(condition: Condition, specs: Sequence[FieldSpec]) -> None:
    """FilterError naming the field unless the condition names one of `specs` and gives exactly one
    of value, any_of (not empty) or range (on a numeric field, a range that can hold a value), its
    values of the field's type."""
    name = condition.field
    if not name:
        raise FilterError("", "a condition has no field name")
    spec = next((s for s in specs if s.name == name), None)
    if spec is None:
        declared = ", ".join(s.name for s in specs) or "none"
        raise FilterError(name, f"is not filterable in this index version (filterable: {declared})")
    given = [m for m in ("value", "any_of", "range") if getattr(condition, m) is not None]
    if len(given) != 1:
        raise FilterError(name, "a condition needs exactly one of value, any_of or range")
    if condition.value is not None:
        _value(spec, condition.value)
    elif condition.any_of is not None:
        if not condition.any_of:
            raise FilterError(name, "any_of has no values")
        for value in condition.any_of:
            _value(spec, value)
    else:
        if not spec.numeric:
            raise FilterError(name, f"a range needs a numeric field, this one holds {spec.type} values")
        _check_range(name, condition.range)


def _value(spec: FieldSpec, text: str) -> str | int | float:
    try:
        return spec.parse(text)
    except ValueError:
        raise FilterError(spec.name, f"{text!r} is not a {spec.type} value") from None


def _check_range(name: str, bounds: Range) -> None:
    """At least one bound, at most one on each side, all finite, and not empty by construction."""
    given = {k: getattr(bounds, k) for k in ("gte", "gt", "lte", "lt") if getattr(bounds, k) is not None}
    if not given:
        raise FilterError(name, "range has no bounds")
    if "gte" in given and "gt" in given or "lte" in given and "lt" in given:
        raise FilterError(name, "range has two bounds on one side (give one of gte/gt and one of lte/lt)")
    if not all(math.isfinite(v) for v in given.values()):
        raise FilterError(name, "range bounds must be finite numbers")
    low = given.get("gte", given.get("gt"))
    high = given.get("lte", given.get("lt"))
    if low is not None and high is not None:
        inclusive = "gte" in given and "lte" in given
        if low > high or (low == high and not inclusive):
            raise FilterError(name, f"range is contradictory: no number is {_bound_text(given)}")


def _bound_text(given: dict[str, float]) -> str:
    symbols = {"gte": ">=", "gt": ">", "lte": "<=", "lt": "<"}
    return " and ".join(f"{symbols[k]} {v:g}" for k, v in given.items())


def declared_json(specs: Sequence[FieldSpec]) -> dict[str, str]:
    """Specs as the manifest records them: name → type."""
    return {s.name: s.type for s in specs}


def specs_of(declared: dict[str, str]) -> list[FieldSpec]:
    return [FieldSpec(name, kind) for name, kind in declared.items()]
