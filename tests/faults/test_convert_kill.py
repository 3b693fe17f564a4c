"""``lightning-gpuopt convert`` killed (SIGKILL, SIGTERM) at seeded points of its run.

Each point is found by watching the child, not by timing it:

- ``startup``: a seeded delay after the start, while the interpreter imports (no temporary file yet);
- ``scan``: the converter has begun (h5py is loaded, or a source folder is open) and no temporary file exists
  yet, on a folder of 12,000 files so listing it takes a while;
- ``decode``: the temporary file exists and decode workers run, but the converter has not written one
  image's bytes yet (``wchar`` of ``/proc/PID/io``);
- ``write``: the converter has written a seeded fraction (10-70 %) of the finished store's bytes.

After each kill: no process of the conversion is left, no ``OUT.tmp-*`` is left, and ``OUT`` is either
absent or a complete store equal to a reference conversion. Every other case starts with an older store at
``OUT`` (``--overwrite``): it must be untouched unless the new store is complete.
"""

from __future__ import annotations

import random

import pytest

from tests.faults._helpers import SIZE, convert_argv, sha256, store_differences, temp_files
from tests.faults._watch import SIGNALS, Watch, kill_at

#: the points of each signal: (phase, index); the seed of a point is its id
POINTS = [("startup", 0)] + [("scan", i) for i in range(3)] + [("decode", i) for i in range(3)]
POINTS += [("write", i) for i in range(5)]
CASES = [(name, phase, i, k % 2 == 1) for name in SIGNALS for k, (phase, i) in enumerate(POINTS)]
_IMAGE_BYTES = SIZE * ((SIZE * 3 + 1) // 2) * 3


def _trigger(phase: str, rng: random.Random, out, src, reference_bytes: int):
    tmp_glob = out.name + ".tmp-"

    def temps(watch: Watch) -> list:
        return [p for p in out.parent.iterdir() if p.name.startswith(tmp_glob)]

    if phase == "startup":
        delay = rng.uniform(0.02, 0.3)

        def fire(watch: Watch):
            return {"delay_s": round(delay, 3)} if watch.elapsed >= delay and not temps(watch) else None

    elif phase == "scan":

        def fire(watch: Watch):
            if temps(watch):
                return {"missed": "the temporary file exists already"}
            src_open = any(p.startswith(str(src)) for p in watch.open_paths())
            if src_open or watch.maps("libhdf5"):
                return {"src_open": src_open}
            return None

    elif phase == "decode":

        def fire(watch: Watch):
            if not temps(watch):
                return None
            written = watch.written()
            if written >= _IMAGE_BYTES:
                return {"missed": f"{written} bytes written already"}
            if watch.children():
                return {"written": written}
            return None

    else:
        fraction = rng.uniform(0.1, 0.7)

        def fire(watch: Watch):
            written = watch.written()
            if temps(watch) and written >= fraction * reference_bytes:
                return {"fraction": round(fraction, 3), "written": written}
            return None

    return fire


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signal_name", "phase", "index", "existing"),
    CASES,
    ids=[f"{s}-{p}{i}-{'overwrite' if e else 'new'}" for s, p, i, e in CASES],
)
def test_convert_killed(sources, case_dir, signal_name, phase, index, existing):
    rng = random.Random(f"convert-{signal_name}-{phase}-{index}")
    out = case_dir / "out.h5"
    before = None
    if existing:
        before = sha256(sources.old_store)
        out.write_bytes(sources.old_store.read_bytes())
    src = sources.scan if phase == "scan" else sources.main
    argv = convert_argv(src, out, "--workers", "2", *(["--overwrite"] if existing else []))
    killed = kill_at(
        argv,
        SIGNALS[signal_name],
        _trigger(phase, rng, out, src, sources.reference_bytes),
        str(case_dir),
        cwd=case_dir,
    )
    detail = killed.describe()
    assert killed.reached and "missed" not in killed.seen, f"the {phase} point was not reached: {detail}"
    assert not killed.survivors, f"processes outlived the killed conversion: {detail}"
    assert temp_files(out) == [], f"temporary files left: {temp_files(out)}; {detail}"
    if out.exists():
        if before is not None and sha256(out) == before:
            return  # the older store, untouched
        diff = store_differences(out, sources.reference)
        assert diff == [], f"OUT is neither absent/untouched nor complete: {diff}; {detail}"
    else:
        assert before is None, f"the existing OUT was removed by a conversion that did not finish; {detail}"
