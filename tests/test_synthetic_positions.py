"""The synthetic router over long decodes routes like real routing by decode position: lru's copies
a token fall over a request's first steps and then stay flat, as on the shared Llama-4-Maverick trace
(config/calibration/decode-position.json, written by scripts/trace_by_position.py, whose ``command``
field says how), instead of rising again as the decode drifts to experts the cache has not seen.

The statistics are each curve's own ratios (a bucket's copies a token over the first 16 decode
steps'), which carry across model shapes; the model here is the default spec at tiny widths
(hidden 128), its routing knobs the defaults, two seeds."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from coldset.engine.synthetic import SyntheticSpec

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ROOT / "config" / "calibration" / "decode-position.json"
TINY = dict(hidden=128, moe_intermediate=32, heads=2, kv_heads=1, head_dim=32)
BUCKETS = (0, 8, 16, 32, 64, 128)
MID, LATE = BUCKETS.index(32), BUCKETS.index(64)  # buckets [32, 64) and [64, 128)
SEEDS = (0, 1)
KEY = "lru@0.5"
# How far the synthetic ratios may lie from the real trace's: beyond its requests' bootstrap band
# (late over early), above its late-over-mid ratio (drift), for the synthetic curves' own sampling
# (24 held-out requests a seed, two seeds).
TOLERANCE = 0.2
DRIFT_TOLERANCE = 0.08


def _script():
    spec = importlib.util.spec_from_file_location("trace_by_position", ROOT / "scripts" / "trace_by_position.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ratios(**knobs) -> list[list[float]]:
    """Per seed of ``SEEDS``, lru's copies a token at residency 0.5 by decode bucket over the first 16
    steps' on the synthetic model: 48 fixture prompts (24 profile, 24 held out) cut to 48 tokens,
    128 decode steps each."""
    tbp = _script()
    out = []
    for seed in SEEDS:
        spec = SyntheticSpec(**TINY, **knobs, seed=seed)
        profile, heldout = tbp.synthetic_requests(spec, per_domain=16, new_tokens=129, prompt_tokens=48)
        assert {h.shape[0] for h in heldout} == {128}
        out.append(tbp.by_bucket(profile, heldout, spec.experts, [0.5], ["lru"], BUCKETS)["ratio_to_first16"][KEY])
    return out


def _checks(ratios: list[list[float]], real: dict) -> dict[str, bool]:
    """Per check, whether the synthetic curves (mean over seeds) pass it against the real targets."""
    late = sum(r[LATE] for r in ratios) / len(ratios)
    drift = sum(r[LATE] / r[MID] for r in ratios) / len(ratios)
    ratio, band = real["ratio_to_first16"][KEY], real["ratio_band"][KEY]
    return {"late_over_early": band[LATE][0] - TOLERANCE <= late <= band[LATE][1] + TOLERANCE,
            # the real curve does not rise again after 32 steps: late over mid at most the real's
            "no_drift": drift <= ratio[LATE] / ratio[MID] + DRIFT_TOLERANCE}


@pytest.fixture(scope="module")
def real():
    return json.loads(TARGETS.read_text())


def test_targets_are_the_real_trace_by_position(real):
    assert real["command"].startswith("python scripts/trace_by_position.py ") and "--buckets" in real["command"]
    assert real["trace"] == "llama4-maverick-mmlu.parquet"
    assert [a for a, _ in real["buckets"]] + [real["buckets"][-1][1]] == list(BUCKETS)
    lru = real["ratio_to_first16"][KEY]
    assert lru[0] > 1 > lru[-1]  # the real curve falls: the request's own experts become resident
    assert all(lo <= r <= hi for r, (lo, hi) in zip(lru, real["ratio_band"][KEY]))


def test_default_router_keeps_the_real_shape_over_long_decodes(real):
    ratios = _ratios()
    assert _checks(ratios, real) == {"late_over_early": True, "no_drift": True}, (ratios, real["ratio_to_first16"][KEY])


def test_a_router_without_topic_palettes_drifts_and_is_refused(real):
    # a fresh topic for every run (with the token-level spread calibrated without palettes): the
    # decode keeps reaching new experts, lru's copies rise again after the first 32 steps
    ratios = _ratios(topic_palette=0, router_noise=0.3)
    assert not _checks(ratios, real)["no_drift"], ratios
