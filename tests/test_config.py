"""Workflow config: schema defaults, errors naming the field, the CLI's handling of bad input."""

import subprocess
import sys

import pytest

from coldset.config import ConfigError, Layout, load_config, validate_config
from coldset.pipeline import StageError, run_stage


def test_defaults_are_filled_and_paths_laid_out():
    cfg = validate_config({})
    assert cfg["model"]["name"] == "synthetic-moe" and cfg["placement"]["residency"] == [0.25, 0.5, 0.75, 1.0]
    assert cfg["bench"]["batch_sizes"] == [1] and cfg["parity"]["max_new_tokens"] == 64
    layout = Layout.from_config(cfg)
    assert str(layout.placement("usage_global", 0.5)) == "results/placement/synthetic-moe/usage_global-0.5.json"
    assert layout.tracking_uri(cfg).startswith("sqlite:////")


@pytest.mark.parametrize("bad, field", [
    ({"placement": {"residency": [1.5]}}, "placement.residency.0"),
    ({"model": {"dtype": "int8"}}, "model.dtype"),
    ({"bench": {"batch_sizes": [0]}}, "bench.batch_sizes.0"),
    ({"fixtures": {"nope": 1}}, "fixtures"),
])
def test_bad_values_name_the_field(bad, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate_config(bad)


def test_cli_reports_a_bad_config_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("device: tpu\n")
    out = subprocess.run([sys.executable, "-m", "coldset", "fixtures", "--config", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "device" in out.stderr and str(path) in out.stderr
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_unknown_synthetic_setting_is_an_error(tmp_path):
    cfg = validate_config({"results": str(tmp_path), "model": {"synthetic": {"layerz": 2}}})
    with pytest.raises(StageError, match="layerz"):
        run_stage("model", cfg)
    assert not (tmp_path / "model" / "synthetic-moe" / "hf").exists()
