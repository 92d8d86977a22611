"""Optional dependencies: one place that says whether they are there and which extra brings them."""

from __future__ import annotations

import importlib.util
from functools import cache


@cache
def is_available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def require(module: str, extra: str, *, purpose: str) -> None:
    """Raise an ImportError that names the pip extra when `module` is missing."""
    if not is_available(module):
        raise ImportError(
            f"{purpose} needs the '{module}' package, which is not installed: pip install 'rldiag[{extra}]'"
        )


def is_transformers_available() -> bool:
    return is_available("transformers")


def is_trl_available() -> bool:
    return is_available("trl")


def is_vllm_available() -> bool:
    return is_available("vllm")


# What each extra brings (top-level module names), so that a missing one can be named with its extra.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "app": ("streamlit", "plotly", "pandas", "tsdownsample", "adbc_driver_sqlite", "adbc_driver_manager",
            "pyarrow", "requests"),
    "hf": ("transformers", "trl", "accelerate"),
    "vllm": ("vllm",),
    "postgres": ("psycopg2",),
    "import": ("tensorboard", "wandb"),
}


def extra_for(error: ImportError) -> str | None:
    """The pip extra that brings the module an ImportError names (None when no extra does)."""
    name = (getattr(error, "name", None) or "").split(".")[0]
    return next((extra for extra, mods in EXTRA_MODULES.items() if name in mods), None)
