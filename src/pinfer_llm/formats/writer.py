"""Writing whole GGUF and PowerInfer (PWRI) files, atomically (formats/atomic.py).

A PowerInfer file is a GGUF v3 file whose first four bytes are b"PWRI" and whose tensor type ids are PowerInfer's
(constants.POWERINFER_TYPE_IDS: its I32 is 18, today's ggml's is 26). write_gguf maps types accordingly and refuses
what PowerInfer's loader cannot take (types it lacks, arrays of arrays). Updating an existing model in place (a few
MB of statistics or a plan) does not come through here: see formats/update.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from pinfer_llm.formats import constants as C
from pinfer_llm.formats.atomic import atomic_output
from pinfer_llm.formats.encoder import (
    RawTensor,
    as_tensor,
    check_powerinfer_metadata,
    encode_header,
    powerinfer_type,
    progress_bar,
    pwrite_all,
    write_array,
)

# --- whole files --------------------------------------------------------------------------------------------------

def write_gguf(path: str | os.PathLike, metadata: dict[str, Any], tensors: dict[str, np.ndarray | RawTensor], *,
               value_types: dict[str, tuple[int, int | None]] | None = None, powerinfer: bool = False,
               alignment: int = C.DEFAULT_ALIGNMENT, progress: bool = False) -> Path:
    """Write a GGUF (or PWRI) file atomically.

    metadata must hold general.architecture (written first). Value types are inferred from Python/numpy types unless
    given in value_types (a rewrite passes the source file's types so that nothing changes type). Plain arrays are
    written as their dtype (float32 -> F32, float16 -> F16, int32 -> I32); RawTensor carries any ggml type through.
    """
    path = Path(path)
    arch = metadata.get(C.ARCHITECTURE)
    if not arch:
        raise ValueError("metadata needs general.architecture")
    value_types = dict(value_types or {})
    meta = {C.ARCHITECTURE: arch}
    meta.update((k, v) for k, v in metadata.items() if k not in (C.ARCHITECTURE, C.ALIGNMENT))
    value_types.pop(C.ALIGNMENT, None)
    if powerinfer:
        check_powerinfer_metadata(meta, value_types)
    items = []
    pos = 0
    for name, t in tensors.items():
        data, ggml_type, ne = as_tensor(name, t)
        stored = powerinfer_type(name, ggml_type) if powerinfer else ggml_type
        items.append((name, ne, stored, pos, data))
        pos += -(-data.nbytes // alignment) * alignment
    head = encode_header(C.PWRI_MAGIC if powerinfer else C.GGUF_MAGIC, meta, value_types,
                         [(n, ne, s, o) for n, ne, s, o, _ in items], alignment)
    data_offset = -(-len(head) // alignment) * alignment
    with atomic_output(path) as fd:
        pwrite_all(fd, head.ljust(data_offset, b"\0"), 0)
        total = sum(d.nbytes for *_, d in items)
        with progress_bar(progress and total > 256 << 20, total, f"writing {path.name}") as advance:
            for _, _, _, off, data in items:
                write_array(fd, data, data_offset + off, advance)
        os.ftruncate(fd, data_offset + pos)  # the last tensor's padding
    return path
