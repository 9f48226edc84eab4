import sys
from pathlib import Path

sys.path.insert(0, str(Path(workflow.basedir) / "src"))  # a plain clone works without `pip install -e`

from coldset.config import Layout, check_config, residency_label

# Cross-field and file checks before any job starts: a job that fails on a setting has already
# had its old outputs deleted by Snakemake (config/schema.yaml holds the rest).
check_config(config, "config")
LAYOUT = Layout.from_config(config)
POLICIES = config["placement"]["policies"]
RESIDENCIES = [residency_label(r) for r in config["placement"]["residency"]]
PLACEMENTS = [f"{p}-{r}" for p in POLICIES for r in RESIDENCIES]
DOMAINS = config["fixtures"]["domains"]
RESULTS = config["results"]
MODEL = config["model"]["name"]


def model_inputs(wildcards=None):
    """The model stage's manifest: every model-reading rule depends on it."""
    return LAYOUT.model_dir / "manifest.json"
