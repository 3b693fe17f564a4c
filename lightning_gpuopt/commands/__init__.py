"""The `lightning-gpuopt` subcommands: each parses its arguments, calls one library function and prints."""
