import sys
from pathlib import Path

sys.path.insert(0, str(Path(workflow.basedir) / "src"))  # a plain clone works without `pip install -e`

from coldset.config import Layout, residency_label

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
