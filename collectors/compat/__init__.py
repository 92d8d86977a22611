"""Private APIs of torch and MLflow that rldiag relies on, each in one module per dependency, pinned by
tests/collectors/test_compat.py to the installed versions."""
