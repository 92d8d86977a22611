"""The `rldiag` command line: `rldiag.app.cli.main:main` is the entry point, one module per command."""
