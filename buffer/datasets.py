"""Prompt data sets on local files: JSONL, Parquet, HF ``datasets`` saved with ``save_to_disk``.

:func:`iter_prompts` yields the prompts of one epoch in a deterministic shuffled order (seed and
epoch), each with its ``epoch`` and ``index`` set, so the producer can resume at a cursor. A file
is read and every row mapped once per process and cached, so rows that cannot be prompts stop it
at once with one :class:`DataError` naming the first few. A row's prompt is
``row[data.messages_field]`` (chat turns) when present, else ``row[data.text_field]`` (or, without
one, ``question`` or ``problem``: GSM8K's and MATH's shapes); its id is
``row["id"]`` or ``row["prompt_id"]``, else ``"<file name>:<row>"``; every other field goes to
``metadata`` (nested values as JSON strings).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from rlhf_core.config import DataConfig
from rlhf_core.config.data import TEXT_FIELD_FALLBACKS
from rlhf_core.errors import UserError
from rlhf_core.records import Prompt
from rlhf_core.wire import pack

_SCALARS = (str, int, float, bool)
_cache: dict[tuple, list[Prompt]] = {}
#: a data set's rows, each with where it is in the file ("line 3", "row 2")
Rows = list[tuple[str, dict[str, Any]]]
#: bad rows named in the DataError of a data set that has some (the count says how many in all)
BAD_ROWS_SHOWN = 3


class DataError(UserError, ValueError):
    """A prompt data set that cannot be read; the message names the file, row and field."""


def iter_prompts(
    data_cfg: DataConfig,
    epoch: int,
    builtin: Callable[[DataConfig, int], Iterable[Prompt]] | None = None,
) -> Iterator[Prompt]:
    """The prompts of ``epoch``, shuffled with ``(data.seed, epoch)``."""
    if data_cfg.source == "builtin":
        if builtin is None:
            raise DataError("data.source=builtin needs the built-in task's prompt function (pass builtin=...)")
        prompts = list(builtin(data_cfg, epoch))
    else:
        prompts = load_prompts(data_cfg)
    for i, j in enumerate(_order(len(prompts), data_cfg.seed, epoch)):
        p = prompts[j]
        yield Prompt(p.prompt_id, p.text, p.messages, dict(p.metadata), epoch=epoch, index=i)


def _order(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([int(seed), int(epoch)]).permutation(n)


def load_prompts(data_cfg: DataConfig) -> list[Prompt]:
    """Every row of ``data.path`` as a prompt, in file order (cached); :class:`DataError` if any
    row cannot be one, naming the first :data:`BAD_ROWS_SHOWN` and counting them all."""
    path = data_path(data_cfg)
    st = path.stat()
    key = (data_cfg.source, str(path.resolve()), st.st_size, st.st_mtime_ns, data_cfg.text_field, data_cfg.messages_field)
    if key not in _cache:
        loaders: dict[str, Callable[[Path], Rows]] = {"jsonl": _jsonl, "parquet": _parquet, "hf_disk": _hf_disk}
        loader = loaders.get(data_cfg.source)
        if loader is None:
            raise DataError(f"data.source={data_cfg.source} is not a prompt file: one of {', '.join(loaders)}")
        rows = loader(path)
        if not rows:
            raise DataError(f"data set {str(path)!r} has no rows")
        prompts: list[Prompt] = []
        bad: list[str] = []
        for j, (where, row) in enumerate(rows):
            try:
                prompts.append(row_to_prompt(row, data_cfg, f"{path.name}:{j}"))
            except DataError as exc:
                bad.append(f"{where}: {exc}")
        if bad:
            raise DataError(f"{len(bad)} of the {len(rows)} rows of {path} cannot be prompts; fix or remove them "
                            f"(the first {min(len(bad), BAD_ROWS_SHOWN)}: {'; '.join(bad[:BAD_ROWS_SHOWN])})")
        _cache.clear()  # one data set per process is the normal case; do not hold several
        _cache[key] = prompts
    return _cache[key]


def data_path(data_cfg: DataConfig, name: str = "data") -> Path:
    """``data_cfg.path`` as a path that exists; a :class:`DataError` naming ``name`` (``data``,
    ``eval.data``) otherwise. ``rlhf-run`` checks it before anything starts."""
    if not data_cfg.path:
        raise DataError(f"{name}.source={data_cfg.source} needs {name}.path (a local file or directory)")
    path = Path(os.path.expanduser(data_cfg.path))
    if not path.exists():
        where = "" if path.is_absolute() else f"; a relative path is read from the current folder, {os.getcwd()}"
        raise DataError(f"{name}.path {str(path)!r} does not exist ({name}.source={data_cfg.source}{where})")
    return path


def _jsonl(path: Path) -> Rows:
    rows: Rows = []
    try:
        f = path.open("rb")  # decoded line by line, so a byte that is not UTF-8 is named by its line
    except OSError as exc:  # a folder, no permission
        raise DataError(f"cannot read {path} (data.source=jsonl): {exc.strerror}") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} of "
                                "the line); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: each line must be a JSON object, got {type(row).__name__}")
            rows.append((f"line {lineno}", row))
    return rows


def _parquet(path: Path) -> Rows:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover
        raise DataError("data.source=parquet needs pyarrow: pip install 'rlhf-service[data]'") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # noqa: BLE001  # pyarrow raises several types for a bad file
        raise DataError(f"cannot read Parquet file {path}: {exc}") from None
    return [(f"row {j}", row) for j, row in enumerate(rows)]


def _hf_disk(path: Path) -> Rows:
    try:
        import datasets
    except ImportError:  # pragma: no cover
        raise DataError("data.source=hf_disk needs the datasets package: pip install 'rlhf-service[data]'") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001
        raise DataError(f"cannot load a datasets.save_to_disk directory from {path}: {exc}") from None
    if isinstance(ds, datasets.DatasetDict):
        split = "train" if "train" in ds else next(iter(ds))
        ds = ds[split]
    return [(f"row {j}", row) for j, row in enumerate(ds.to_list())]


def row_to_prompt(row: dict[str, Any], data_cfg: DataConfig, default_id: str) -> Prompt:
    """One row as a prompt (epoch and index 0: :func:`iter_prompts` sets them); :class:`DataError`
    saying what is wrong with it (the caller names the row)."""
    messages = None
    mf = data_cfg.messages_field
    tf = text_field(row, data_cfg.text_field)
    text = row.get(tf)
    if mf and row.get(mf) is not None:
        messages = row[mf]
        if not (isinstance(messages, list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
        )):
            raise DataError(f"field {mf!r} must be a list of {{'role': str, 'content': str}} turns")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if not isinstance(text, str):
            text = ""
    elif not isinstance(text, str):
        have = ", ".join(sorted(row)) or "none"
        raise DataError(
            f"no string field {data_cfg.text_field!r} (fields: {have}); set data.text_field "
            "or data.messages_field to the field holding the prompt"
        )
    pid = row.get("id", row.get("prompt_id"))
    prompt_id = str(pid) if pid is not None else default_id
    skip = {tf, mf, "id", "prompt_id"}
    metadata = {k: _meta_value(v) for k, v in row.items() if k not in skip and isinstance(k, str)}
    prompt = Prompt(prompt_id, text, messages, metadata)
    try:
        prompt.encode()
    except (OverflowError, UnicodeEncodeError):  # msgpack's: an integer beyond 64 bits, a lone surrogate
        raise DataError(_unencodable({"id": prompt_id, tf: text, mf: messages, **metadata})) from None
    return prompt


def text_field(row: dict[str, Any], configured: str) -> str:
    """The field holding the row's prompt: ``configured``, or for the default ``prompt`` a row
    without one may have GSM8K's ``question`` or MATH's ``problem`` instead."""
    if configured != "prompt" or "prompt" in row:
        return configured
    return next((f for f in TEXT_FIELD_FALLBACKS if isinstance(row.get(f), str)), configured)


def _unencodable(fields: dict[Any, Any]) -> str:
    """What in ``fields`` (a prompt's values by the row's field names) the wire cannot carry."""
    for name, value in fields.items():
        try:
            pack({"v": value})
        except OverflowError:
            return (f"field {name!r} holds an integer beyond 64 bits ({str(value)[:60]}), which the wire cannot carry; "
                    "write it as a string in the file")
        except UnicodeEncodeError as exc:
            return (f"field {name!r} holds a lone surrogate {exc.object[exc.start:exc.end]!r} (half of a \\uXXXX pair, "
                    "e.g. an emoji's escape cut in two), which is not text; fix it in the file")
    return "it cannot be encoded for the wire"


def _meta_value(v: Any) -> Any:
    if v is None or isinstance(v, _SCALARS):
        return v
    if isinstance(v, list) and all(x is None or isinstance(x, _SCALARS) for x in v):
        return v
    return json.dumps(v, default=str)
