"""Screenshot TensorBoard's scalars page for a log folder with headless Chromium.

Starts ``tensorboard --logdir LOGDIR`` on a local port, waits until it serves the run's scalars, opens the
scalars dashboard filtered to the monitor's keys in headless Chromium and writes a PNG. Nothing leaves the
machine: TensorBoard listens on 127.0.0.1 and Chromium runs with networking features off.

``--logdir`` may be the demo's output folder (``gpuopt_runs/demo``: its newest ``version_<n>`` run is
shown), one run of it (``gpuopt_runs/demo/version_0``) or any TensorBoard folder; for a demo run the
monitored fit (``version_<n>/tensorboard/fit``) is shown, not the ladder's rows beside it.

    python tools/screenshot_tensorboard.py --logdir gpuopt_runs/demo \
        --out docs/images/tensorboard_demo_cpu.png

Needs ``tensorboard`` (extra ``tensorboard``) and Chromium (Debian: ``apt-get install -y chromium``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
#: GPUStatsMonitor's key prefixes
TAG_FILTER = "gpu/|time/|throughput/|host/"
RUN_PREFIX = "version_"  # the demo's run folders (lightning_gpuopt.bench.runs)


def _run_number(path: Path) -> int | None:
    suffix = path.name[len(RUN_PREFIX) :]
    return int(suffix) if path.name.startswith(RUN_PREFIX) and suffix.isdigit() else None


def resolve_logdir(path: Path) -> Path:
    """The TensorBoard folder to show for ``path``.

    A demo output folder (holding ``version_<n>`` runs) gives its newest run's monitored fit,
    ``version_<n>/tensorboard/fit``; a run folder ``version_<n>`` gives its ``tensorboard/fit``; any other
    folder is used as it is. Raises ``FileNotFoundError`` naming the folder when it does not exist.
    """
    if not path.is_dir():
        raise FileNotFoundError(
            f"--logdir {path} is not a folder; give the demo's --out folder or a log folder"
        )
    runs = sorted((n, p) for p in path.iterdir() if p.is_dir() and (n := _run_number(p)) is not None)
    if runs and _run_number(path) is None:
        path = runs[-1][1]
    fit = path / "tensorboard" / "fit"
    if _run_number(path) is not None and fit.is_dir():
        return fit
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tensorboard_cmd(explicit: str | None) -> list[str]:
    if explicit:
        return [explicit]
    beside = Path(sys.executable).parent / "tensorboard"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("tensorboard")
    return [found] if found else [sys.executable, "-m", "tensorboard.main"]


def _browser(explicit: str | None) -> str:
    for name in (explicit,) if explicit else BROWSERS:
        path = shutil.which(name) if name else None
        if path:
            return path
    raise FileNotFoundError(
        f"no Chromium found (looked for {', '.join(BROWSERS)}); `apt-get install -y chromium`"
    )


def _wait_for_scalars(base: str, pattern: str, timeout_s: float) -> dict[str, list[str]]:
    """Poll TensorBoard until some run has a scalar tag; return run -> tags."""
    deadline = time.monotonic() + timeout_s
    last_err: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/data/plugin/scalars/tags", timeout=5) as r:
                tags = json.loads(r.read())
            found = {run: sorted(t) for run, t in tags.items() if t}
            if found:
                return found
        except OSError as err:  # not listening yet
            last_err = err
        time.sleep(0.5)
    raise TimeoutError(f"TensorBoard at {base} served no scalars within {timeout_s:.0f} s ({last_err})")


def screenshot(
    logdir: Path,
    out: Path,
    tag_filter: str = TAG_FILTER,
    port: int | None = None,
    width: int = 1600,
    height: int = 1000,
    budget_ms: int = 20000,
    tensorboard: str | None = None,
    browser: str | None = None,
) -> dict[str, list[str]]:
    """Write ``out`` (PNG) showing TensorBoard's scalars for ``logdir``; return the run -> tags it served."""
    logdir = resolve_logdir(logdir)
    port = port or _free_port()
    base = f"http://127.0.0.1:{port}"
    chromium = _browser(browser)
    tb = subprocess.Popen(
        [*_tensorboard_cmd(tensorboard), "--logdir", str(logdir), "--port", str(port), "--host", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        tags = _wait_for_scalars(base, tag_filter, timeout_s=60)
        fragment = urllib.parse.urlencode(
            {"tagFilter": tag_filter, "_smoothingWeight": "0", "_ignoreYOutliers": "false"},
            quote_via=urllib.parse.quote,
        )
        url = f"{base}/?darkMode=false#scalars&{fragment}"
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
            cmd = [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                f"--virtual-time-budget={budget_ms}",
                f"--screenshot={out.resolve()}",
                url,
            ]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"chromium failed ({done.returncode}): {done.stderr[-2000:]}")
        return tags
    finally:
        tb.terminate()
        try:
            tb.wait(timeout=10)
        except subprocess.TimeoutExpired:
            tb.kill()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--logdir",
        required=True,
        type=Path,
        help="the demo's --out folder, one of its version_<n> runs, or a log folder",
    )
    parser.add_argument("--out", type=Path, default=Path("docs/images/tensorboard_gpu_stats.png"))
    parser.add_argument("--filter", default=TAG_FILTER, help="TensorBoard tag filter (regex)")
    parser.add_argument("--port", type=int, default=None, help="port for TensorBoard (default: a free one)")
    parser.add_argument("--width", type=int, default=1600)
    parser.add_argument("--height", type=int, default=1000)
    parser.add_argument("--budget-ms", type=int, default=20000, help="Chromium virtual time before the shot")
    parser.add_argument("--tensorboard", default=None, help="tensorboard executable (default: beside python)")
    parser.add_argument("--browser", default=None, help=f"browser executable (default: first of {BROWSERS})")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    tags = screenshot(
        args.logdir,
        args.out,
        args.filter,
        args.port,
        args.width,
        args.height,
        args.budget_ms,
        args.tensorboard,
        args.browser,
    )
    for run, names in tags.items():
        print(f"{run}: {', '.join(names)}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
