# coldset: usage-aware MoE expert offload, as one declarative experiment workflow.
# Stages and file contracts: docs/design.md §1 and docs/architecture.md.
#   snakemake --cores all report    the whole pipeline (the default profile sets cores)
#   snakemake parity_gate           the token-exact gate alone

import sys
from pathlib import Path

from snakemake.io import IOFile
from snakemake.logging import logger as snakemake_logger
from snakemake.utils import min_version

sys.path.insert(0, str(Path(workflow.basedir) / "src"))  # a plain clone works without `pip install -e`

from coldset.workflow.config import ConfigError, validate_config
from coldset.workflow.entry import InterruptWatch, interrupted_line, rerun_restored_outputs

# Ctrl-C: one line saying what was kept and how to resume (onerror), instead of a RuleException per job.
INTERRUPTS = InterruptWatch().install(snakemake_logger)

min_version("9.0")


configfile: "config/config.yaml"


# The schema's check with defaults filled (coldset.workflow.config.validate_config): an unknown key
# is named with the nearest known one, in a line or two, not followed by the schema.
try:
    validate_config(config, source=" + ".join(map(str, workflow.overwrite_configfiles or ["config/config.yaml"])))
except ConfigError as exc:
    sys.exit(f"coldset: {exc}")


report: "report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/model.smk"
include: "workflow/rules/fixtures.smk"
include: "workflow/rules/routing.smk"
include: "workflow/rules/stats.smk"
include: "workflow/rules/placement.smk"
include: "workflow/rules/cache.smk"
include: "workflow/rules/autotune.smk"
include: "workflow/rules/parity.smk"
include: "workflow/rules/bench.smk"
include: "workflow/rules/track.smk"
include: "workflow/rules/vllm.smk"
include: "workflow/rules/gpu_report.smk"


if SWEEPING:  # models: every model's stages, then one report comparing them

    include: "workflow/rules/sweep.smk"

else:

    include: "workflow/rules/report.smk"


# A failed job leaves the previous run's outputs in place (the rules flag them update(), except
# the parity gate's verdict); here they lose the failed job's record, so that it runs again next time.
onerror:
    _kept = rerun_restored_outputs(log, lambda p: workflow.persistence.cleanup_metadata(IOFile(str(p))))
    if INTERRUPTS.interrupted:
        print(interrupted_line(), file=sys.stderr)
    else:
        for _path in _kept:
            print(f"kept {_path} from the previous run; its job runs again next time", file=sys.stderr)


rule all:
    default_target: True
    input:
        comparison_path(config) if SWEEPING else LAYOUT.report,
