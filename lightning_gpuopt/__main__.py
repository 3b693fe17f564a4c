"""``python -m lightning_gpuopt`` is the ``lightning-gpuopt`` command."""

from lightning_gpuopt.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
