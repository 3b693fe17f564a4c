# subcommands of the lightning-gpuopt CLI, one module each (see cli.py)
