"""``python -m coldset bench replay``: choose among cache policies by simulated time, on the CPU,
from what a ``bench cache --save-replays`` run on the GPU kept.

Reads ``cache_bench.json`` and ``cache_replays.npz`` of one ``bench cache`` output folder: the
all-HBM routing of each batch size, the pre-gated lookahead lists at several depths (k and k + 4
candidates), the profile counts, and from the JSON the run's all-HBM step per batch, its measured
link read rate and each policy's management per group (its residency-1.0 row; override or add with
``--manage-us POLICY=US``, e.g. to ask what lookahead would reach at lru's cost). Replays ``lru``
and ``lookahead`` at every kept (depth, candidates), ``lru_guard`` (lru's management), with four
references beside them:

- ``belady`` (offline: every miss admitted, the victim the resident used furthest ahead; no
  prefetch, no management): the fewest demand copies any eviction order makes at that capacity, so
  its link bytes bound what better eviction alone can buy;
- ``lookahead oracle`` at depths 1, 2, 4 and 8 (after layer ``l``, the experts the run selected at
  layer ``l + d`` of the same step) and ``nexttoken oracle`` (after layer ``l``, those of layer ``l``
  at the next step), no management: what a perfect forecast reaches under each mechanism's timing,
  so a target is checked against the mechanism before the forecast is blamed;
- ``nexttoken oracle evict hH`` for H in 1, 2, 4 and 8 (``nexttoken`` with ``prefetch_budget=0``;
  after layer ``l``, the experts the run selected at layer ``l`` in each of the next H steps,
  concatenated; no management): eviction by a perfect forecast of H tokens and no prefetch, every
  missed expert a demand copy. The victim is the least recent resident not named in the next H
  steps where one exists, so the row bounds what eviction by predicted next use buys with a
  forecast H tokens deep, and its gap to ``lru`` says how far ahead a forecast must see for a
  link-bound batch to move fewer bytes. The forecast is a set, not a ranking: while the next H
  steps' experts fit in the pool the row nears ``belady`` as H grows (which sees the whole replay
  and ranks by next use); once they do not, the victims are the least recent of the named ones, and
  a longer horizon can cost more copies than a shorter one (where one step's experts already exceed
  the pool, h8 can move more bytes than h2).

Each goes through :func:`coldset.analysis.simulate.simulate` and
:func:`coldset.analysis.time_model.simulate_time` (the engine's model: link "share", join "step"
or, with ``--join use``, a wait only where a group selects a copied expert, which no engine does
yet; ``manage_ms``), at each ``--residencies``; prints per (batch, residency) the policies by
simulated step, fastest first, with x all-HBM, overlap and the fraction of the bound, and the
measured x all-HBM where the run measured the same row. The gated policies' prefetch gate unit
(:func:`coldset.analysis.policies.base.prefetch_lead_unit`) is the run's where its JSON records one
(``lead_unit``, the engine's), else the policies' default; ``--gate-unit measured`` takes the
replay's own time model's (:meth:`coldset.analysis.time_model.TimeModel.lead_unit`), and
``--expert-bytes`` replays the same routing with experts of another size (the link bytes and the
time model follow, the gate unit with ``--gate-unit measured``, required where the run recorded
one for its own experts; the measured column is then left out). The lists are
:func:`coldset.analysis.forecast.lookahead_predictions`' (float32 logits): the engine ranks its
own logits, so near-ties may differ from the lists it recorded. No GPU needed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from coldset.analysis.simulate import capacity_for_residency, simulate
from coldset.analysis.streams import AccessStream
from coldset.analysis.policies import REGISTRY
from coldset.analysis.time_model import TimeModel, manage_ms_per_group, simulate_time
from coldset.measure.harness import MeasureError
from coldset.measure.render import _f, table

LIST_KEY = re.compile(r"^b(\d+)_lookahead_d(\d+)_n(\d+)$")
ORACLE_DEPTHS = (1, 2, 4, 8)
EVICT_HORIZONS = (1, 2, 4, 8)  # nexttoken oracle evict hH (module doc)


def oracle_lists(routing, num_experts: int, depth: int | None, horizon: int = 1):
    """int64 ``[steps * L, horizon * B * k]`` prefetch lists (-1 padded) naming the instances the run
    selected: ``depth`` d: after group (t, l) those of layer ``l + d`` at step ``t`` (none past the
    last layer); ``None``: those of layer ``l`` at steps ``t + 1 .. t + horizon``, one block of
    ``B * k`` per step in step order (a block past the last step all -1). ``horizon`` > 1 only with
    ``depth`` None (a lookahead names one later layer of its own step).
    ``routing``: int ``[steps, L, B, k]`` expert ids."""
    if int(horizon) != horizon or horizon < 1 or (depth is not None and horizon != 1):
        raise ValueError(f"oracle_lists: horizon {horizon!r} must be an integer >= 1, and 1 with a depth ({depth})")
    steps, L, B, k = routing.shape
    inst = routing.astype(np.int64).reshape(steps, L, B * k) + (np.arange(L) * num_experts)[None, :, None]
    out = np.full((steps, L, horizon, B * k), -1, dtype=np.int64)
    if depth is None:
        for j in range(1, min(horizon, steps - 1) + 1):
            out[:-j, :, j - 1] = inst[j:]
    elif depth < L:
        out[:, :L - depth, 0] = inst[:, depth:]
    return out.reshape(steps * L, horizon * B * k)


def add_arguments(p) -> None:
    p.add_argument("folder", help="a bench cache --save-replays output folder (cache_bench.json, cache_replays.npz)")
    p.add_argument("--residencies", default="0.25,0.5,0.75", help="comma-separated, each in (0, 1)")
    p.add_argument("--join", choices=("step", "use"), default="step",
                   help="when the compute waits for a prefetch: at the step's end, as the engine's captured step "
                        "does (default), or only when a group selects the copied expert (what a device-side wait "
                        "on a per-slot tag would allow; no engine does it yet)")
    p.add_argument("--manage-us", action="append", default=[], metavar="POLICY=US",
                   help="a policy's management per group in µs (default: the run's residency-1.0 row), repeatable")
    p.add_argument("--gate-unit", choices=("recorded", "measured"), default="recorded",
                   help="the gated policies' prefetch gate unit: the run's (its JSON's lead_unit, else the default) "
                        "or the replay's time model's")
    p.add_argument("--expert-bytes", type=int, default=None,
                   help="replay the same routing with experts of this many bytes (a what-if: link bytes and time "
                        "model follow, the gate unit with --gate-unit measured; no measured column)")


def _manage_overrides(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        try:
            us = float(value)
        except ValueError:
            raise MeasureError(f"--manage-us {item!r}: expected POLICY=MICROSECONDS") from None
        if name not in ("lru", "lookahead") or us < 0:
            raise MeasureError(f"--manage-us {item!r}: the policy must be lru or lookahead and the time >= 0")
        out[name] = us
    return out


def replay_table(result: dict, arrays, residencies: list[float], manage_us: dict[str, float],
                 join: str = "step", gate_unit: str = "recorded", expert_bytes: int | None = None) -> list[dict]:
    """One row per (batch, residency, policy variant): the simulated replay and its time (module
    doc). ``result``: cache_bench.json; ``arrays``: cache_replays.npz's arrays (a mapping);
    ``gate_unit`` and ``expert_bytes``: as ``--gate-unit`` and ``--expert-bytes``."""
    # the simulator loads numba: here, when a replay runs, not whenever the bench command line loads

    counts = np.asarray(arrays["profile_counts"], dtype=np.float64)
    L, E = counts.shape
    per_expert = int(arrays["expert_bytes"]) if expert_bytes is None else int(expert_bytes)
    if per_expert < 1:
        raise MeasureError(f"--expert-bytes {per_expert}: at least 1")
    if expert_bytes is not None and gate_unit == "recorded" and result.get("lead_unit"):
        raise MeasureError(f"--expert-bytes {expert_bytes}: the run recorded its gate unit for its own experts "
                           f"({int(arrays['expert_bytes'])} bytes); give --gate-unit measured")
    link = result.get("ceilings", {}).get("link_read_gb_s")
    if not link:
        raise MeasureError("cache_bench.json has no measured link read rate (ceilings.link_read_gb_s)")
    rows = []
    batches = sorted({int(m.group(1)) for k in arrays for m in [re.match(r"^b(\d+)_routing$", k)] if m})
    if not batches:
        raise MeasureError("cache_replays.npz holds no b<batch>_routing array: written by bench cache --save-replays?")
    for b in batches:
        measured = {r["placement"]: r for r in result["rows"] if r["batch"] == b}
        if "all-HBM" not in measured:
            raise MeasureError(f"cache_bench.json has no all-HBM row at batch {b}")
        allhbm = measured["all-HBM"]["step_ms_mean"]
        manage = {}
        for pol, full in (("lru", "lru-1.0"), ("lookahead", "lookahead-1.0 d1")):
            if full in measured:
                manage[pol] = manage_ms_per_group(measured[full]["step_ms_mean"], allhbm, L) * 1e3
        manage.update(manage_us)
        if "lru" in manage:  # the same launches as lru's: its guard is one subtraction in the same scan
            manage.setdefault("lru_guard", manage["lru"])
        routing = np.asarray(arrays[f"b{b}_routing"]).astype(np.int64)
        steps, _, B, k = routing.shape
        inst = (routing + (np.arange(L) * E)[None, :, None, None]).reshape(-1)
        stream = AccessStream(inst, np.arange(0, inst.size + 1, B * k), steps * B, L, E)
        # (policy, depth, candidates, lists, oracle, evict-only horizon: 0 = prefetch as the policy does)
        variants = [("lru", 0, 0, None, False, 0), ("lru_guard", 0, 0, None, False, 0),
                    ("belady", 0, 0, None, False, 0)]
        for key in sorted(arrays, key=lambda s: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", s)]):
            m = LIST_KEY.match(key)
            if m and int(m.group(1)) == b:
                variants.append(("lookahead", int(m.group(2)), int(m.group(3)), np.asarray(arrays[key]), False, 0))
        variants += [("lookahead", d, 0, oracle_lists(routing, E, d), True, 0) for d in ORACLE_DEPTHS if d < L]
        variants.append(("nexttoken", 0, 0, oracle_lists(routing, E, None), True, 0))
        variants += [("nexttoken", 0, 0, oracle_lists(routing, E, None, h), True, h) for h in EVICT_HORIZONS]
        recorded = (result.get("lead_unit") or {}).get(str(b))
        for r in residencies:
            C = capacity_for_residency(r, L, E)
            for pol, depth, n, lists, oracle, horizon in variants:
                manage_us = 0.0 if oracle else manage.get(pol, 0.0)
                model = TimeModel(allhbm, per_expert, link, link="share", join=join, manage_ms=manage_us / 1e3)
                lead = None
                if REGISTRY[pol].gated:
                    lead = model.lead_unit(L) if gate_unit == "measured" else recorded
                res = simulate(stream, pol, C, counts, predictions=lists, prefetch_budget=0 if horizon else None,
                               lead_unit=lead)
                ts = simulate_time(stream, res, model)
                name = f"{pol}-{r}" + (f" d{depth}" if depth else "")  # (belady, oracles: never a measured row)
                st = res.stats()
                same = measured.get(name) if not oracle and (pol in ("lru", "lru_guard") or n == k) \
                    and expert_bytes is None else None
                rows.append({"batch": b, "residency": r, "policy": pol, "depth": depth, "candidates": n or None,
                             "lead_unit": lead,
                             "oracle": oracle, "evict_horizon": horizon or None, "manage_us": manage_us,
                             "hit_rate": st.hit_rate,
                             "link_gb_per_token": ts.link_gb_per_token, "step_ms": ts.step_ms,
                             "x_all_hbm": allhbm / ts.step_ms, "overlap": ts.overlap,
                             "bound_fraction": ts.bound_fraction,
                             "measured_x_all_hbm": allhbm / same["step_ms_mean"] if same else None})
    return rows


def _variant(row: dict) -> str:
    """A replayed row's policy as the table names it."""
    if row["policy"] == "belady":
        return "belady (offline reference)"
    if row.get("evict_horizon"):
        return f"{row['policy']} oracle evict h{row['evict_horizon']}"
    if row.get("oracle"):
        return row["policy"] + " oracle" + (f" d{row['depth']}" if row["depth"] else "")
    return row["policy"] + (f" d{row['depth']} n{row['candidates']}" if row["depth"] else "")


def render_replay(rows: list[dict]) -> str:
    out = []
    for b, r in sorted({(x["batch"], x["residency"]) for x in rows}):
        group = sorted((x for x in rows if x["batch"] == b and x["residency"] == r), key=lambda x: x["step_ms"])
        body = [[_variant(x), _f(x["manage_us"]),
                 f"{x['hit_rate']:.4f}", f"{x['link_gb_per_token']:.4f}", f"{x['step_ms']:.3f}",
                 f"{x['x_all_hbm']:.3f}", _f(x["overlap"], ".2f"), f"{x['bound_fraction']:.2f}",
                 _f(x["measured_x_all_hbm"], ".3f")] for x in group]
        out.append(f"**batch {b}, residency {r}** (simulated, fastest first)\n\n" + table(
            ["policy", "management µs/group", "hit rate", "link GB/token", "simulated step ms", "x all-HBM",
             "overlap", "of bound", "measured x all-HBM"], body))
    return "\n\n".join(out) + "\n"


def run(args) -> list[dict]:
    folder = Path(args.folder)
    jpath, npath = folder / "cache_bench.json", folder / "cache_replays.npz"
    for p in (jpath, npath):
        if not p.is_file():
            raise MeasureError(f"{p}: no such file (bench cache --save-replays --out {folder} writes both)")
    try:
        residencies = [float(x) for x in args.residencies.split(",")]
    except ValueError as exc:
        raise MeasureError(f"--residencies {args.residencies!r}: {exc}") from None
    if not all(0 < r < 1 for r in residencies):
        raise MeasureError(f"--residencies {residencies}: each must be in (0, 1)")
    with np.load(npath) as arrays:
        return replay_table(json.loads(jpath.read_text()), dict(arrays), residencies,
                            _manage_overrides(args.manage_us), join=args.join, gate_unit=args.gate_unit,
                            expert_bytes=args.expert_bytes)
