"""The workflow configuration: load, validate against config/schema.yaml, fill defaults, lay out paths.

The Snakefile validates with ``snakemake.utils.validate``; ``python -m coldset`` (for machines
without Snakemake) uses :func:`load_config`, which applies the same JSON Schema with the same
default filling. :class:`Layout` is the one place that names every stage's files, so the
Snakefile and the CLI cannot disagree about where a stage reads or writes.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import jsonschema
import yaml

from coldset.core.placement import PlacementError, lookahead_depths, residency_label
from coldset.core.shapes import MXFP4, ShapeError, read_shape
from coldset.core.trace import TraceError, read_trace_meta
from coldset.reporting.track_store import default_tracking_uri
from coldset.trace.fixtures import FixtureError, available_domains, fixtures_by_domain
from coldset.trace.importers import export_files, is_engine_export

REPO_ROOT = Path(__file__).resolve().parents[3]
SCHEMA_PATH = REPO_ROOT / "config" / "schema.yaml"


class ConfigError(ValueError):
    """A configuration file or value that does not match config/schema.yaml."""


def _defaults_filling_validator(schema: dict):
    base = jsonschema.validators.validator_for(schema)

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and name not in instance:
                    instance[name] = json.loads(json.dumps(sub["default"]))
        yield from base.VALIDATORS["properties"](validator, properties, instance, schema)

    return jsonschema.validators.extend(base, {"properties": set_defaults})(schema)


def validate_config(config: dict, schema_path: Path = SCHEMA_PATH, source: str = "config") -> dict:
    """Fill schema defaults into ``config`` (in place) and validate it; errors name the field."""
    schema = yaml.safe_load(Path(schema_path).read_text())
    validator = _defaults_filling_validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [line for e in errors for line in _error_lines(e)]
        raise ConfigError(f"{source} does not match {schema_path}:\n" + "\n".join(lines))
    return config


def _error_lines(error) -> list[str]:
    """One line per problem of a schema error: an unknown key gets its path and the nearest known
    key at that level (``did you mean``), never the schema; anything else the validator's message."""
    where = ".".join(str(p) for p in error.absolute_path)
    known = error.schema.get("properties") if isinstance(error.schema, dict) else None
    if error.validator != "additionalProperties" or not known or not isinstance(error.instance, dict):
        return [f"  {where or '(top level)'}: {error.message}"]
    lines = []
    for key in sorted(set(error.instance) - set(known), key=str):
        path = f"{where}.{key}" if where else str(key)
        close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
        hint = f"did you mean {where + '.' if where else ''}{close[0]}?" if close else \
            f"known keys here: {', '.join(known)}"
        lines.append(f"  {path}: unknown key; {hint}")
    return lines


def check_config(config: dict, source: str = "config") -> dict:
    """Checks across fields and against the file system that JSON Schema cannot express, run
    before any job starts (the Snakefile calls it after ``validate``; :func:`load_config` too):
    a late failure costs reruns, and Snakemake deletes a job's old outputs before it runs, so a
    stage that fails on a bad setting has already destroyed valid results. Errors name the field."""
    problems: list[str] = []
    model = config["model"]
    if model["path"] and model["synthetic"]:
        problems.append("model.path and model.synthetic are both set: choose one")
    if model["path"]:
        path = Path(model["path"])
        if not path.exists():
            problems.append(f"model.path: {path} does not exist")
        elif not path.is_dir():
            problems.append(f"model.path: {path} is not a folder (a Hugging Face model folder with config.json)")
    labels = [residency_label(r) for r in config["placement"]["residency"]]
    if len(set(labels)) != len(labels):
        problems.append(f"placement.residency: {config['placement']['residency']} repeats a residency")
    depth = config["cache"]["lookahead_depth"]
    if isinstance(depth, dict):  # JSON Schema checks the type; the keys (YAML: integers) are checked here
        try:
            lookahead_depths(depth, None, "cache.lookahead_depth")  # the upper bound: the placement stage's
        except PlacementError as exc:
            problems.append(str(exc))
    fx = config["fixtures"]
    for key in ("fixtures.prompts", "fixtures.template_dir", "routing.trace", "bench.routing_trace"):
        section, name = key.split(".")
        value = config[section][name]
        if value and not Path(value).exists():
            problems.append(f"{key}: {value} does not exist")
    if not fx["prompts"] and not (fx["template_dir"] and not Path(fx["template_dir"]).is_dir()):
        known = available_domains(fx["template_dir"])
        missing = [d for d in fx["domains"] if d not in known]
        if missing:
            problems.append(f"fixtures.domains: no template for {missing} (templates: {known}; add "
                            "{domain}.j2 files to fixtures.template_dir)")
    profile = config["placement"]["profile_domains"]
    if isinstance(profile, list) and not config["routing"]["trace"] and not fx["prompts"]:
        unknown = [d for d in profile if d not in fx["domains"]]
        if unknown:
            problems.append(f"placement.profile_domains: {unknown} are not among fixtures.domains {fx['domains']}")
    if not problems:  # the files' contents, once they are known to exist
        problems += input_file_problems(config)
    if problems:
        raise ConfigError(f"{source}:\n" + "\n".join(f"  {p}" for p in problems))
    return config


def bench_request_count(num_domains: int, requests_per_domain: int, batch_size: int) -> int:
    """How many distinct requests the bench decodes at ``batch_size`` (``bench.requests_per_domain``
    of each of ``num_domains`` domains, timed ``batch_size`` at a time: several batches of one at
    b1, and at least one full batch of distinct requests: b8 = eight). Here, not in
    :mod:`coldset.bench.decode`, so that the config check counts fixtures without importing torch."""
    wanted = num_domains * requests_per_domain
    return max(1, wanted // batch_size) * batch_size


def decoding_support(config: dict) -> str | None:
    """None when the embedded engine can decode the configured model; else why not.

    The synthetic model always decodes. A ``model.path`` folder decodes when its ``config.json``
    is a family the engine runs (``coldset.engine.loading.ENGINE_MODEL_TYPES``) and it holds weights
    (``*.safetensors``); a folder with only ``config.json`` (or weights of another architecture)
    is a shape-only model: enough for stats, placement, the speed model and report.
    """
    path = config["model"]["path"]
    if not path:
        return None
    folder = Path(path)
    cfg = folder / "config.json"
    if not cfg.is_file():
        return None  # the model stage reports the missing file
    try:
        raw = json.loads(cfg.read_text())
        model_type = raw.get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return None  # the model stage reports the broken file
    from coldset.engine.loading import ENGINE_MODEL_TYPES, read_config  # loads torch: the Snakefile asks this while it builds the DAG
    from coldset.engine.model import ModelLoadError  # loads torch, as the line above

    if model_type not in ENGINE_MODEL_TYPES:
        return (f"{cfg}: model_type {model_type!r} is not one the embedded engine runs "
                f"({', '.join(ENGINE_MODEL_TYPES)})")
    if not any(folder.glob("*.safetensors")):
        return f"{folder} holds no weights (*.safetensors), only the model's shape"
    try:
        read_config(folder)  # the family's own refusals: variants and weight formats it does not decode
    except ModelLoadError as exc:
        return str(exc)
    return None


# Stages that decode with the embedded engine (or feed only those): skipped for a shape-only model.
DECODING_STAGES = ("autotune", "parity", "parity_gate", "bench")


def experts_format_choice(stored: str, experts_format: str, dtype: str, decodes: bool) -> tuple[str, str | None]:
    """``(format, problem)``: the format the routed experts run and move in, from the format the
    checkpoint stores them in (:attr:`coldset.core.shapes.MoEShape.expert_format`), the config's
    ``model.experts_format`` and ``model.dtype``; ``problem`` (else None) says which keys refuse it:
    ``dequantized`` for experts that are not MXFP4, and MXFP4 kept 4-bit for a decoded model whose
    ``model.dtype`` is not bfloat16 (the MXFP4 kernels' activations). One rule for the config check
    (before Snakemake schedules a job) and the stages (:func:`coldset.workflow.process_engine.experts_format`)."""
    if experts_format == "dequantized":
        if stored != MXFP4:
            return dtype, (f"model.experts_format: dequantized dequantizes MXFP4 experts, but the model stores its "
                           f"routed experts as {stored}; set it to checkpoint")
        return dtype, None
    if stored == MXFP4 and decodes and dtype != "bfloat16":
        return stored, (f"model.dtype {dtype}: the model stores its routed experts in MXFP4, which run kept 4-bit "
                        "(model.experts_format: checkpoint) with bfloat16 activations; set model.dtype: bfloat16, "
                        f"or model.experts_format: dequantized to run them dequantized to {dtype}")
    return stored, None


def skipped_stages(config: dict) -> dict[str, str]:
    """The stages the workflow leaves out for this config, each with the reason (the report shows
    them): the decoding stages of a shape-only model."""
    reason = decoding_support(config)
    if reason is None:
        return {}
    return {stage: f"{reason}; {stage} decodes the model" for stage in DECODING_STAGES}


def _bench_request_problems(config: dict, by_domain: dict) -> list[str]:
    """Whether the bench split holds enough distinct requests for every bench batch size
    (:func:`bench_request_count`; their token lengths are checked by the stage)."""
    bc = config["bench"]
    if decoding_support(config) is not None:
        return []  # a shape-only model is not benched
    split = bc["prompt_split"]
    pool = [f for fxs in by_domain.values() for f in fxs if split == "all" or f.split == split]
    domains = len({f.domain for f in pool})
    short = [b for b in bc["batch_sizes"] if len(pool) < bench_request_count(max(domains, 1), bc["requests_per_domain"], b)]
    if not short:
        return []
    need = max(bench_request_count(max(domains, 1), bc["requests_per_domain"], b) for b in short)
    return [f"bench.batch_sizes {short}: the bench times distinct {split} requests, {need} of them, and the "
            f"fixtures hold {len(pool)} (raise fixtures.per_domain or fixtures.heldout_fraction, or lower "
            "bench.requests_per_domain / the batch sizes)"]


def input_file_problems(config: dict) -> list[str]:
    """What is wrong inside the user's files (prompts, templates, model folder, traces), found
    by the checks their stages would fail on, kept cheap enough for every Snakemake start: the
    prompts and templates are read and rendered as the fixtures stage does (a few dozen
    prompts); a model folder's ``config.json`` is read as a shape (:func:`coldset.core.shapes.read_shape`);
    a Parquet trace's columns and schema metadata are read from its footer, not its rows
    (:func:`coldset.core.trace.read_trace_meta`; the routing stage still validates every row). A
    job that fails on something found only later keeps its previous outputs (the rules flag them
    ``update``)."""
    problems: list[str] = []
    fx = config["fixtures"]
    try:
        by_domain = fixtures_by_domain(fx["domains"], fx["per_domain"], fx["heldout_fraction"], fx["max_new_tokens"],
                                       fx["seed"], template_dir=fx["template_dir"], user_prompts=fx["prompts"])
    except FixtureError as exc:
        problems.append(f"{'fixtures.prompts' if fx['prompts'] else 'fixtures.domains'}: {exc}")
    else:
        problems += _bench_request_problems(config, by_domain)
    shape = None
    if config["model"]["path"]:
        try:
            shape = read_shape(config["model"]["path"])
        except ShapeError as exc:
            problems.append(f"model.path: {exc}")
        else:
            m = config["model"]
            problem = experts_format_choice(shape.expert_format, m["experts_format"], m["dtype"],
                                            decoding_support(config) is None)[1]
            if problem:
                problems.append(f"{m['path']}: {problem}")
    trace, kind = config["routing"]["trace"], config["routing"]["trace_format"]
    if trace:
        try:
            if kind in ("coldset", "parquet") or (kind == "auto" and Path(trace).suffix == ".parquet"):
                read_trace_meta(trace, expect=shape)
            elif is_engine_export(trace):
                if not config["model"]["path"]:
                    problems.append(f"routing.trace: {trace} is an engine export, which carries no model shape: "
                                    "set model.path to the model's folder (its config.json is enough)")
                export_files(trace)
            elif Path(trace).is_file() and Path(trace).stat().st_size == 0:
                problems.append(f"routing.trace: {trace} is empty")
        except (TraceError, UnicodeDecodeError) as exc:
            problems.append(f"routing.trace: {exc}")
    if config["bench"]["routing_trace"]:
        try:
            read_trace_meta(config["bench"]["routing_trace"])
        except TraceError as exc:
            problems.append(f"bench.routing_trace: {exc}")
    return problems


def merge_configs(base: dict, overlay: dict) -> dict:
    """``overlay`` over ``base``: mappings merged key by key at every depth, anything else replaced
    (a list too), as Snakemake merges ``--configfile`` overlays, so one overlay file means the same
    to ``python -m coldset`` and to ``snakemake``."""
    out = dict(base)
    for key, value in overlay.items():
        out[key] = merge_configs(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else value
    return out


def load_config(paths: str | Path | Sequence[str | Path], schema_path: Path = SCHEMA_PATH) -> dict:
    """Read a YAML workflow config, or several layered in order (:func:`merge_configs`: later files
    override earlier ones), validate the result, fill defaults and :func:`check_config` it."""
    paths = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    config: dict = {}
    for path in paths:
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
        if not isinstance(doc, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, not {type(doc).__name__}")
        config = merge_configs(config, doc)
    source = " + ".join(str(p) for p in paths)
    return check_config(validate_config(config, schema_path, source=source), source=source)


def config_hash(config: dict) -> str:
    """A short stable hash of the validated config (MLflow tag and experiment suffix)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]


def tracking_uri(config: dict) -> str:
    """The configured tracking server, or the SQLite store under results/ (absolute URI)."""
    return config["tracking"]["uri"] or default_tracking_uri(Path(config["results"]))


# --------------------------------------------------------------------------------------------
# models: sweeps (one validated config per model; coldset.workflow.sweep runs and compares them)

ROUTING_KEYS = {"trace": "trace", "trace_domains": "trace_domains"}


def model_configs(config: dict) -> dict[str, dict]:
    """One validated config per model of ``models:`` (or the config itself, keyed by its model name)."""
    models = config.get("models") or {}
    if not models:
        return {config["model"]["name"]: config}
    out = {}
    for name, section in models.items():
        if not isinstance(section, dict):
            raise ConfigError(f"config models.{name}: expected a model section (an object), got {section!r}")
        section = dict(section)
        if "name" in section and section["name"] != name:
            raise ConfigError(f"config models.{name}: name {section['name']!r} differs from its key")
        routing = {ROUTING_KEYS[k]: section.pop(k) for k in list(section) if k in ROUTING_KEYS}
        c = copy.deepcopy({k: v for k, v in config.items() if k != "models"})
        c["model"] = {**c.get("model", {}), **section, "name": name}
        c["routing"] = {**c.get("routing", {}), **routing}
        out[name] = validate_config(c, source=f"config models.{name}")
    return out


def comparison_path(config: dict) -> Path:
    """Where the comparison report goes: ``results/report/models.html``."""
    return Path(config["results"]) / "report" / "models.html"
