"""scripts/codec_ratios.py at a tiny shape: one row per weight distribution and format, each ratio the
compressed tier's bytes over the raw tier's, never under the entropy bound of what it codes, and
the draws of the stated std."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from codec_ratios import draw  # noqa: E402  (a script, imported by path)


def test_codec_ratios_prints_and_writes_one_row_per_distribution_and_format(tmp_path):
    out = tmp_path / "ratios.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "codec_ratios.py"), "--shapes", "tiny:256:128",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["weights"], r["format"]) for r in rows] == [
        (w, f) for w in ("gaussian", "student-t df=4") for f in ("bf16", "fp8", "mxfp4")]
    for r in rows:
        assert r["ratio"] == r["tier_bytes"] / r["raw_bytes"]
        assert r["entropy_bound"] <= r["ratio"] <= 1.0, r
        assert f"| {r['ratio']:.4f} |" in done.stdout
    bf16 = rows[0]
    assert bf16["coded"] == "w13,w2" and bf16["ratio"] < 0.8
    assert bf16["raw_bytes"] == (2 * 128 * 256 + 256 * 128) * 2


def test_draws_have_std_one_over_sqrt_fan_in_and_the_t_draw_heavier_tails():
    rng = np.random.default_rng(0)
    g, t = draw(512, 400, "gaussian", 4.0, rng), draw(512, 400, "student-t", 4.0, rng)
    for w in (g, t):
        assert abs(float(w.std()) * math.sqrt(400) - 1) < 0.05
    kurtosis = [float(((w / w.std()) ** 4).mean()) for w in (g, t)]
    assert abs(kurtosis[0] - 3) < 0.2 and kurtosis[1] > 5
