"""The parity fingerprint's model digest notices a changed model folder (issue 16 item 2)."""

import json
import os

import pytest

from coldset.core.files import write_json
from coldset.verify.fingerprint import (
    StaleReportError,
    check_fingerprint,
    file_sha256,
    model_files,
    model_fingerprint,
)


def test_model_fingerprint_checks_the_folder_it_describes(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    (folder / "README.md").write_text("not read by the engine")
    manifest = write_json(tmp_path / "manifest.json", {"path": str(folder), "files": model_files(folder)})
    assert [f["file"] for f in json.loads(manifest.read_text())["files"]] == ["config.json", "model.safetensors"]
    assert model_fingerprint(manifest) == file_sha256(manifest)
    (folder / "README.md").write_text("edited")  # not a model file: same model
    assert model_fingerprint(manifest) == file_sha256(manifest)
    (folder / "model.safetensors").write_bytes(b"y" * 11)  # new weights, same name
    with pytest.raises(StaleReportError, match=r"model folder .*hf changed since the model stage .*\['model.safetensors'\]"):
        model_fingerprint(manifest)
    os.remove(folder / "model.safetensors")
    with pytest.raises(StaleReportError, match=r"\['model.safetensors'\]"):
        model_fingerprint(manifest)


def test_check_fingerprint_names_the_report_and_each_changed_file():
    now = {"row_map_sha256": "a", "placement": "p", "model": "b", "kernel": "c"}
    files = {"row_map_sha256": "x.rowmap.npy", "placement": "x.json", "model": "manifest.json",
             "kernel": "autotune.json"}
    check_fingerprint(dict(now), now, "r.json", files)
    with pytest.raises(StaleReportError, match=r"r.json is stale: .*changed: row_map_sha256 \(x.rowmap.npy\), "
                                               r"kernel \(autotune.json\)"):
        check_fingerprint({**now, "row_map_sha256": "z", "kernel": "z"}, now, "r.json", files)
    with pytest.raises(StaleReportError, match="r.json has no fingerprint"):
        check_fingerprint(None, now, "r.json", files)
