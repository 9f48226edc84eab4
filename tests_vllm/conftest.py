"""The vLLM cross-engine tests: run only in the separate vLLM environment (``.ci/vllm``).

They live outside tests/ so the main suite never collects them. tests/hf_fixtures.py (the tiny
transformers-built checkpoints) is shared with the main suite.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
