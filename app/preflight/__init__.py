"""`rldiag preflight`: engine–trainer logprob parity at equal weights before a run starts, knob by knob.

    from rldiag.app.preflight import PreflightConfig, run_preflight
    result = run_preflight(PreflightConfig(Path("my-model"), {"logprobs_mode": "processed_logprobs"},
                                           temperature=0.7, top_p=0.9))
    print(result.verdict)

Needs vLLM and transformers (`pip install 'rldiag[vllm,hf]'`, or plain `vllm` on a CUDA machine),
imported when a check runs; importing this package loads neither (nor torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rldiag.collectors.lazy import lazy_exports

if TYPE_CHECKING:
    from rldiag.app.preflight.check import Measurement, PreflightResult, run_preflight
    from rldiag.app.preflight.config import KNOBS, TRAINER_LOGPROBS, PreflightConfig

__all__ = ["KNOBS", "TRAINER_LOGPROBS", "Measurement", "PreflightConfig", "PreflightResult", "run_preflight"]
_EXPORTS = {"Measurement": "rldiag.app.preflight.check", "PreflightResult": "rldiag.app.preflight.check",
            "run_preflight": "rldiag.app.preflight.check", "KNOBS": "rldiag.app.preflight.config",
            "TRAINER_LOGPROBS": "rldiag.app.preflight.config", "PreflightConfig": "rldiag.app.preflight.config"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
