"""Writes tests/data/mds-*/ with mosaicml-streaming's own MDSWriter (run once; the outputs are committed).

The library is not a test dependency (it would pull torch 2.14 and CUDA wheels), so the MDS reader's
tests read these datasets written by the real writer, plus fixtures tests/test_tokens.py writes itself.
Made with mosaicml-streaming 0.13.0, installed apart (pip install --no-deps --target DIR
mosaicml-streaming zstd brotli python-snappy cramjam pillow catalogue), run as
PYTHONPATH=DIR python tests/data/make_mds.py.
"""

import shutil
import sys
import types
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def samples(n: int, seed: int) -> list[np.ndarray]:
    """The token arrays the tests expect: sample i holds (i * 7 + seed) % 13 + 1 tokens."""
    return [(np.arange((i * 7 + seed) % 13 + 1) + 100 * i + seed) for i in range(n)]


def main() -> None:
    # The package's __init__ imports its torch dataset and transformers; the writer needs neither.
    import importlib.util

    package = Path(importlib.util.find_spec("streaming").submodule_search_locations[0])
    for name, path in (("streaming", package), ("streaming.base", package / "base")):
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        sys.modules[name] = module
    from streaming.base.format.mds.writer import MDSWriter  # noqa: E402

    def write(out: Path, columns: dict, rows: list[dict], **kwargs) -> None:
        shutil.rmtree(out, ignore_errors=True)
        with MDSWriter(out=str(out), columns=columns, **kwargs) as w:
            for row in rows:
                w.write(row)

    a = samples(40, 0)
    write(HERE / "mds-int32-zstd", {"tokens": "ndarray:int32", "text": "str"},
          [{"tokens": t.astype(np.int32), "text": f"doc {i}"} for i, t in enumerate(a)],
          compression="zstd", hashes=["sha1", "xxh3_128"], size_limit=900)
    b = np.arange(16 * 30).reshape(30, 16) % 60000
    write(HERE / "mds-uint16-fixed", {"tokens": "ndarray:uint16:16"},
          [{"tokens": row.astype(np.uint16)} for row in b], size_limit=700)
    for split, seed in (("train", 1), ("val", 2)):
        write(HERE / "mds-splits" / split, {"tokens": "ndarray"},
              [{"tokens": t.astype(np.int64)} for t in samples(12, seed)], size_limit=500)


if __name__ == "__main__":
    main()
