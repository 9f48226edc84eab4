"""Workflow config: schema defaults, errors naming the field, the CLI's handling of bad input."""

import subprocess
import sys
from pathlib import Path

import pytest

from coldset.core.layout import Layout
from coldset.workflow.config import ConfigError, load_config, tracking_uri, validate_config
from coldset.workflow.context import StageError
from coldset.workflow.pipeline import run_stage


def test_defaults_are_filled_and_paths_laid_out():
    cfg = validate_config({})
    assert cfg["model"]["name"] == "synthetic-moe" and cfg["placement"]["residency"] == [0.25, 0.5, 0.75, 1.0]
    assert cfg["bench"]["batch_sizes"] == [1] and cfg["parity"]["max_new_tokens"] == 64
    layout = Layout.from_config(cfg)
    assert str(layout.placement("usage_global", 0.5)) == "results/placement/synthetic-moe/usage_global-0.5.json"
    assert tracking_uri(cfg).startswith("sqlite:////")


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


def test_cli_ctrl_c_prints_one_line_and_exits_130(tmp_path, monkeypatch, capsys):
    """``python -m coldset STAGE`` interrupted: one line saying what was kept and how to resume, no
    traceback, exit status 130."""
    from coldset import cli
    from coldset.workflow import pipeline
    from coldset.workflow.entry import INTERRUPTED_STATUS, interrupted_line

    def fixtures(ctx, **_):
        raise KeyboardInterrupt

    monkeypatch.setitem(pipeline.STAGES, "fixtures", fixtures)
    path = tmp_path / "c.yaml"
    path.write_text(f"results: {tmp_path / 'results'}\n")
    assert cli.main(["fixtures", "--config", str(path)]) == INTERRUPTED_STATUS
    assert capsys.readouterr().err.splitlines() == [interrupted_line("stage fixtures")]


def test_config_overlays_merge_as_snakemake_merges_them(tmp_path):
    """``--config base --config overlay`` (python -m coldset) means what ``--configfile base overlay``
    means to Snakemake: mappings merged at every depth, lists and scalars replaced."""
    import copy

    base, overlay = tmp_path / "base.yaml", tmp_path / "overlay.yaml"
    base.write_text("model: {name: m, synthetic: {layers: 3, experts: 16}}\n"
                    "placement: {policies: [positional, usage_global], residency: [0.25, 0.5]}\n")
    overlay.write_text("model: {synthetic: {experts: 8}}\nplacement: {policies: [lru]}\nbench: {batch_sizes: [1, 4]}\n")
    cfg = load_config([base, overlay])
    assert cfg["model"]["name"] == "m" and cfg["model"]["synthetic"] == {"layers": 3, "experts": 8}
    assert cfg["placement"]["policies"] == ["lru"] and cfg["placement"]["residency"] == [0.25, 0.5]
    assert cfg["bench"]["batch_sizes"] == [1, 4]
    snakemake_utils = pytest.importorskip("snakemake.utils")
    import yaml

    from coldset.workflow.config import merge_configs

    docs = [yaml.safe_load(p.read_text()) for p in (base, overlay)]
    theirs = copy.deepcopy(docs[0])
    snakemake_utils.update_config(theirs, docs[1])
    assert merge_configs(docs[0], docs[1]) == theirs
    overlay.write_text("- not a mapping\n")
    with pytest.raises(ConfigError, match=r"overlay.yaml must hold a mapping"):
        load_config([base, overlay])
    out = subprocess.run([sys.executable, "-m", "coldset", "fixtures", "--config", str(base), "--config",
                          str(tmp_path / "nope.yaml")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "nope.yaml does not exist" in out.stderr


def test_unknown_synthetic_setting_is_an_error(tmp_path):
    # refused by the schema, before any job (once the model stage's, after Snakemake had deleted
    # the valid manifest)
    with pytest.raises(ConfigError, match=r"model\.synthetic\.layerz: unknown key; did you mean model\.synthetic\.layers\?"):
        validate_config({"results": str(tmp_path), "model": {"synthetic": {"layerz": 2}}})
    assert not (tmp_path / "model").exists()


def test_an_unknown_key_is_named_with_the_nearest_known_one():
    """A typo names its file, its key path and the key it probably meant, in a line or two: no
    schema dump (snakemake.utils.validate printed the section's schema after its first line)."""
    with pytest.raises(ConfigError) as err:
        validate_config({"fixtures": {"per_domian": 4}, "benh": {}}, source="my.yaml")
    lines = str(err.value).splitlines()
    assert lines[0].startswith("my.yaml does not match")
    assert lines[1:] == ["  benh: unknown key; did you mean bench?",
                         "  fixtures.per_domian: unknown key; did you mean fixtures.per_domain?"]
    with pytest.raises(ConfigError, match=r"fixtures\.zzz: unknown key; known keys here: domains, per_domain"):
        validate_config({"fixtures": {"zzz": 1}})


def test_snakemake_names_an_unknown_key_without_the_schema(tmp_path):
    (tmp_path / "typo.yaml").write_text("fixtures:\n  per_domian: 4\n")
    exe = Path(sys.executable).with_name("snakemake")
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([str(exe), "-s", str(repo / "Snakefile"), "--configfile", "typo.yaml", "-n"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stderr.splitlines() if not line.startswith("Using workflow specific profile")]
    assert out.returncode == 1
    assert lines == [f"coldset: {tmp_path / 'typo.yaml'} does not match {repo / 'config' / 'schema.yaml'}:",
                     "  fixtures.per_domian: unknown key; did you mean fixtures.per_domain?"], out.stderr


def test_schema_lists_every_synthetic_setting_and_bandwidth_preset():
    import dataclasses

    import yaml

    from coldset.workflow.config import SCHEMA_PATH
    from coldset.core.names import NAME_PATTERN
    from coldset.analysis.speed import BANDWIDTH_PRESETS
    from coldset.engine.synthetic import SyntheticSpec

    schema = yaml.safe_load(SCHEMA_PATH.read_text())["properties"]
    synthetic = schema["model"]["properties"]["synthetic"]
    assert set(synthetic["properties"]) == {f.name for f in dataclasses.fields(SyntheticSpec)}
    assert synthetic["additionalProperties"] is False
    assert schema["placement"]["properties"]["bandwidths"]["enum"] == list(BANDWIDTH_PRESETS)
    patterns = [schema["model"]["properties"]["name"]["pattern"],
                schema["fixtures"]["properties"]["domains"]["items"]["pattern"],
                schema["placement"]["properties"]["profile_domains"]["oneOf"][1]["items"]["pattern"],
                schema["tracking"]["properties"]["experiment"]["pattern"]]
    assert patterns == [NAME_PATTERN] * 4


@pytest.mark.parametrize("bad, field", [
    ({"model": {"synthetic": {"layers": "six"}}}, r"model\.synthetic\.layers"),
    ({"placement": {"bandwidths": "h100"}}, r"placement\.bandwidths: 'h100' is not one of \['h200', 'gb300'\]"),
    ({"placement": {"residency": [0.5, 0.50]}}, r"placement\.residency: \[0\.5, 0\.5\] has non-unique elements"),
    ({"placement": {"policies": ["positional", "positional"]}}, r"placement\.policies: .* non-unique"),
    ({"fixtures": {"domains": ["../../../victim"]}}, r"fixtures\.domains\.0: '\.\./\.\./\.\./victim' does not match"),
    ({"fixtures": {"domains": ["(all)"]}}, r"fixtures\.domains\.0: '\(all\)' does not match"),
    ({"fixtures": {"domains": ["$\\frac{a$"]}}, r"fixtures\.domains\.0: .* does not match"),
    ({"tracking": {"experiment": "../../elsewhere"}}, r"tracking\.experiment: '\.\./\.\./elsewhere' does not match"),
    ({"placement": {"profile_domains": ["a/b"]}}, r"placement\.profile_domains"),
    ({"model": {"name": "x" * 65}}, r"model\.name"),
])
def test_late_failures_are_refused_by_the_schema(bad, field):
    with pytest.raises(ConfigError, match=field):
        validate_config(bad)


def test_check_config_refuses_before_any_job(tmp_path):
    from coldset.workflow.config import check_config

    model_file = tmp_path / "model.safetensors"
    model_file.write_bytes(b"")
    cases = [
        ({"model": {"path": str(model_file)}}, rf"model\.path: {model_file} is not a folder"),
        ({"model": {"path": str(tmp_path / "nope")}}, r"model\.path: .*nope does not exist"),
        ({"model": {"path": str(tmp_path), "synthetic": {"layers": 2}}}, "model.path and model.synthetic are both set"),
        ({"fixtures": {"domains": ["agent", "legal"]}}, r"fixtures\.domains: no template for \['legal'\]"),
        ({"routing": {"trace": str(tmp_path / "t.parquet")}}, r"routing\.trace: .*t\.parquet does not exist"),
        ({"placement": {"profile_domains": ["code", "legal"]}}, r"placement\.profile_domains: \['legal'\] are not"),
        ({"placement": {"residency": [0.5, 0.5000000000000001]}}, None),  # distinct labels: accepted
        # lookahead's depth per batch size (YAML's integer keys): batch 1 must have one, depths >= 1
        ({"cache": {"lookahead_depth": {1: 4, 8: 1}}}, None),
        ({"cache": {"lookahead_depth": {8: 1}}}, r"cache\.lookahead_depth must give batch size 1 a depth"),
        ({"cache": {"lookahead_depth": {1: 2, "eight": 1}}}, r"cache\.lookahead_depth must map batch sizes"),
        ({"cache": {"lookahead_depth": {1: 0}}}, r"cache\.lookahead_depth\[1\] must be an integer >= 1"),
    ]
    for bad, msg in cases:
        cfg = validate_config(bad)
        if msg is None:
            check_config(cfg)
        else:
            with pytest.raises(ConfigError, match=msg):
                check_config(cfg)


def test_the_default_is_a_newcomer_run_and_the_full_grid_keeps_every_policy():
    """Issue 30 item 9: the default config's CPU decoding stays small (the 24-placement default, each
    placement decoded by the gate over 64 tokens of 24 fixtures and benched, took 62 minutes on a
    busy 2-core machine); every placement policy of the schema still runs in the full-grid example."""
    import yaml

    repo = Path(__file__).resolve().parents[1]
    default = load_config([repo / "config/config.yaml"])
    placements = len(default["placement"]["policies"]) * len(default["placement"]["residency"])
    fixtures = len(default["fixtures"]["domains"]) * min(default["fixtures"]["per_domain"],
                                                         default["parity"]["fixtures_per_domain"] or 10**9)
    assert placements <= 6 and fixtures * default["parity"]["max_new_tokens"] <= 12 * 16
    assert default["bench"]["batch_sizes"] == [1] and default["bench"]["new_tokens"] <= 16
    schema = yaml.safe_load((repo / "config/schema.yaml").read_text())
    every = schema["properties"]["placement"]["properties"]["policies"]["items"]["enum"]
    full = load_config([repo / "config/config.yaml", repo / "config/examples/full-grid.yaml"])
    assert sorted(full["placement"]["policies"]) == sorted(every) and len(full["placement"]["residency"]) == 4
    assert full["parity"]["max_new_tokens"] == 64 and full["parity"]["fixtures_per_domain"] is None


def test_reading_and_checking_the_default_config_imports_no_torch():
    """Snakemake parses the workflow (and so reads and checks the config) once a run and once a job:
    torch's import (seconds) is left to the stages that run a model, and to a config naming a
    model folder, whose experts' format is checked against the config."""
    code = ("import sys\n"
            "from coldset.workflow.config import check_config, input_file_problems, load_config\n"
            "cfg = check_config(load_config('config/config.yaml'))\n"
            "assert not input_file_problems(cfg), input_file_problems(cfg)\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
