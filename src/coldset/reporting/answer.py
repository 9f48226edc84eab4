"""The report's answer: for each HBM budget of the run, the placement to choose on this traffic.

On a GPU (measured speed compares placements: ``coldset.core.timing.speed_compares_placements``)
the choice is the fastest measured placement at each batch size, among those that passed the
parity gate and whose timing is not noise. On the CPU every placement runs the same in-memory
computation, so the choice is an estimate: the highest held-out coverage (the share of traffic
the placement was not fitted on that its HBM experts serve), ties broken by the speed model's
predicted tok/s (``coldset.analysis.speed``, recorded in the placement JSON). Each answer names
the GiB the placement needs and its speed against positional (whole layers offloaded in order,
what vLLM's ``--cpu-offload-gb`` does) and against all experts in HBM.

The number formats every table of the report uses are here too (:func:`human`, :func:`tok_s_text`,
:func:`size_text`, :func:`pct_text`): plain digits, never scientific notation or ``nan``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from coldset.core.timing import speed_compares_placements, timing_noisy
from coldset.reporting.results import BenchResult, ParityResult, PlacementSummary

UNDEFINED = "—"


def human(value, digits: int = 4) -> str:
    """``value`` with ``digits`` significant digits in plain notation: ``72,060`` not ``7.206e+04``,
    ``0.00002008`` not ``2.008e-05``, ``0`` for what rounds to zero at ten decimals (float noise
    such as ``1.354e-12``), ``—`` for None, NaN or infinity (undefined)."""
    if value is None:
        return UNDEFINED
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    try:
        v = float(value)
    except (TypeError, ValueError):
        return str(value)
    if not math.isfinite(v):
        return UNDEFINED
    if v == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(v)))
    if magnitude >= digits:
        return f"{v:,.0f}"
    decimals = min(max(digits - 1 - magnitude, 0), 10)
    text = f"{v:.{decimals}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "0", "") else text


def tok_s_text(value: float | None) -> str:
    """Tokens per second, three significant digits: ``73,300 tok/s``, ``69.9 tok/s``."""
    if value is None or not math.isfinite(value):
        return "n/a"
    if value >= 1000:
        return f"{round(value, 2 - math.floor(math.log10(value))):,.0f} tok/s"
    return f"{human(value, 3)} tok/s"


def size_text(gib: float | None) -> str:
    """A size given in GiB, in MiB below 1 GiB: ``36 MiB``, ``2.25 GiB``."""
    if gib is None or not math.isfinite(gib):
        return "n/a"
    if gib == 0:
        return "0 GiB"
    return f"{human(gib * 1024, 3)} MiB" if gib < 1 else f"{human(gib, 3)} GiB"


def pct_text(share: float | None) -> str:
    """A share as a percentage with one decimal: ``91.9%``."""
    if share is None or not math.isfinite(share):
        return "n/a"
    return f"{100 * share:.1f}%"


def faster_text(a: float | None, b: float | None) -> str:
    """How ``a`` compares with ``b`` (speeds): ``6.78× faster``, ``same speed`` within 0.5%,
    ``0.8× (slower)``; ``n/a`` where undefined."""
    if a is None or b is None or not b:
        return "n/a"
    r = a / b
    if abs(r - 1) < 0.005:
        return "same speed"
    return f"{human(r, 3)}× faster" if r > 1 else f"{human(r, 3)}× (slower)"


@dataclass
class SpeedLine:
    """One batch size's speeds of the chosen placement and its two references (text, ready to show)."""

    batch_size: int
    chosen: str
    positional: str
    all_hbm: str


@dataclass
class BudgetAnswer:
    """What the report says for one HBM budget (a configured residency)."""

    residency: str
    choice: str | None  # {policy}-{residency}, or None where no placement qualifies
    why: str  # the ranking's evidence, one sentence
    estimate: bool  # True: chosen by coverage and the speed model (CPU), False: by measured tok/s
    hbm_text: str  # the HBM the choice needs
    host_text: str  # what stays in host memory
    speeds: list[SpeedLine] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _name(p) -> str:
    return f"{p.policy}-{p.residency}"


def _hbm_texts(p: PlacementSummary) -> tuple[str, str]:
    experts = f"{size_text(p.hbm_expert_gib)} of routed experts"
    if p.nonexpert_gib is None:
        hbm = f"{experts} (the other weights not recorded in the placement file)"
    else:
        hbm = (f"{size_text(p.hbm_expert_gib + p.nonexpert_gib)} of weights ({experts} + "
               f"{size_text(p.nonexpert_gib)} of the other weights)")
    if p.num_cold == 0:
        return hbm, "none (every routed expert in HBM)"
    return hbm, f"{size_text(p.host_expert_gib)} of routed experts ({p.num_cold} experts)"


def _predicted(p: PlacementSummary | None, preset: str, batch: int) -> float | None:
    """The speed model's tok/s (perfect overlap: its upper estimate) of ``p`` at ``batch``."""
    if p is None:
        return None
    for q in p.predictions:
        if q["preset"] == preset and q["batch_size"] == batch and q["step_ms_lower"] > 0:
            return batch * 1e3 / q["step_ms_lower"]
    return None


def _all_hbm(placements: list[PlacementSummary]) -> PlacementSummary | None:
    """A placement with every routed expert in HBM that the speed model predicted, if the run has one."""
    full = [p for p in placements if p.num_cold == 0 and p.predictions]
    return min(full, key=lambda p: p.policy != "positional") if full else None


def _estimate_answer(residency: str, group: list[PlacementSummary], placements: list[PlacementSummary],
                     preset: str | None) -> BudgetAnswer:
    """The CPU's choice at one budget: best held-out coverage, then the speed model's tok/s."""
    batches = sorted({q["batch_size"] for p in placements for q in p.predictions if q["preset"] == preset})
    first = batches[0] if batches else 1

    def key(p):
        cov = p.coverage_heldout if p.coverage_heldout is not None else p.coverage_profile
        return (cov, _predicted(p, preset, first) or 0.0)

    best = max(group, key=key)
    if best.num_cold == 0:  # the policies differ only in which experts go to host memory
        hbm, host = _hbm_texts(best)
        answer = BudgetAnswer(residency, _name(best), "every routed expert fits in HBM: each placement at this "
                              "budget is the all-HBM decode", True, hbm, host)
        answer.speeds = [SpeedLine(b, tok_s_text(_predicted(best, preset, b)), "same placement (nothing offloaded)",
                                   "this is the all-HBM decode") for b in batches]
        return answer
    cov_name = "held-out coverage" if best.coverage_heldout is not None else "profile coverage (no held-out split)"
    others = [p for p in group if p is not best]
    why = (f"{cov_name} {pct_text(key(best)[0])}: the share of selections its HBM experts serve"
           + (" (" + ", ".join(f"{_name(p)} {pct_text(key(p)[0])}" for p in others) + ")" if others else ""))
    hbm, host = _hbm_texts(best)
    positional = next((p for p in group if p.policy == "positional"), None)
    full = _all_hbm(placements)
    answer = BudgetAnswer(residency, _name(best), why, True, hbm, host)
    for b in batches:
        mine, pos, ref = (_predicted(best, preset, b), _predicted(positional, preset, b), _predicted(full, preset, b))
        answer.speeds.append(SpeedLine(
            b,
            tok_s_text(mine) if mine else "n/a (the speed model predicts static placements only)",
            "n/a (positional not in this run's policies)" if positional is None else
            f"{tok_s_text(pos)} (the choice: {faster_text(mine, pos)})" if mine and pos else tok_s_text(pos),
            "n/a (no residency-1.0 placement in this run)" if full is None else
            f"{tok_s_text(ref)} (the choice reaches {pct_text(mine / ref) if mine and ref else 'n/a'})"))
    if best.policy not in ("positional", "usage_layer", "usage_global", "permute"):
        answer.notes.append(f"{best.policy} is a slot cache: its coverage is that of its warm start; the cache "
                            "simulation below replays it on the held-out traffic")
    return answer


def _noisy(b: BenchResult) -> bool:
    return timing_noisy(b.metrics["step_ms_p50"], b.metrics["step_ms_p90"], b.metrics.get("repeat_spread"))


def _measured_answer(residency: str, group: list[PlacementSummary], bench: list[BenchResult],
                     failed: set[str]) -> BudgetAnswer:
    """The GPU's choice at one budget: per batch size the fastest measured placement."""
    names = {_name(p) for p in group}
    rows = [b for b in bench if _name(b) in names]
    by_batch: dict[int, list[BenchResult]] = {}
    for b in rows:
        by_batch.setdefault(b.batch_size, []).append(b)
    answer = BudgetAnswer(residency, None, "", False, "", "")
    picks = []
    for batch, at in sorted(by_batch.items()):
        usable = [b for b in at if _name(b) not in failed and not _noisy(b)]
        if not usable:
            answer.notes.append(f"batch {batch}: no placement measured reliably (noisy timing or failed parity)")
            continue
        best = max(usable, key=lambda b: b.metrics["tok_s"])
        picks.append(best)
        pos = next((b for b in at if b.policy == "positional"), None)
        ref_name = str(best.extra.get("allhbm_placement") or "")
        ref = next((b for b in bench if _name(b) == ref_name and b.batch_size == batch), None)
        if ref is None:
            ref = next((b for b in bench if b.batch_size == batch and float(b.residency) == 1.0
                        and b.policy == "positional"), None)
        tok = best.metrics["tok_s"]
        answer.speeds.append(SpeedLine(
            batch,
            f"{_name(best)}: {tok_s_text(tok)}",
            "n/a (positional not in this run's policies)" if pos is None else
            f"{tok_s_text(pos.metrics['tok_s'])} (the choice: {faster_text(tok, pos.metrics['tok_s'])})"
            + (" (noisy timing)" if _noisy(pos) else ""),
            "n/a (no all-HBM placement measured at this batch size)" if ref is None else
            f"{tok_s_text(ref.metrics['tok_s'])} ({_name(ref)}; the choice reaches "
            f"{pct_text(tok / ref.metrics['tok_s'])})"))
    if picks:
        best = max(picks, key=lambda b: sum(1 for p in picks if _name(p) == _name(b)))  # most batch sizes
        answer.choice = _name(best)
        summary = next(p for p in group if _name(p) == answer.choice)
        answer.hbm_text, answer.host_text = _hbm_texts(summary)
        answer.why = "fastest measured decode (tok/s per sequence) " + (
            "at every batch size" if all(_name(p) == answer.choice for p in picks) else
            "at most batch sizes; per batch size below")
    else:
        answer.why = "no placement at this budget has a reliable measurement"
    return answer


def budget_answers(placements: list[PlacementSummary], bench: list[BenchResult], parity: list[ParityResult],
                   preset: str | None) -> list[BudgetAnswer]:
    """One answer per configured residency, smallest budget first (module docstring)."""
    failed = {_name(p) for p in parity if not p.passed}
    measured = any(speed_compares_placements(b.device) for b in bench)
    groups: dict[str, list[PlacementSummary]] = {}
    for p in placements:
        groups.setdefault(p.residency, []).append(p)
    answers = []
    for residency, group in sorted(groups.items(), key=lambda kv: float(kv[0])):
        passed = [p for p in group if _name(p) not in failed]
        if not passed:
            answers.append(BudgetAnswer(residency, None, "every placement at this budget failed the parity gate",
                                        not measured, "n/a", "n/a"))
            continue
        if measured:
            answers.append(_measured_answer(residency, passed, bench, failed))
        else:
            presets = sorted({q["preset"] for p in placements for q in p.predictions})
            use = preset if preset in presets else (presets[0] if presets else None)
            answers.append(_estimate_answer(residency, passed, placements, use))
        if len(passed) < len(group):
            answers[-1].notes.append("left out (failed the parity gate): "
                                     + ", ".join(sorted(_name(p) for p in group if p not in passed)))
    return answers


#: The report's words for :data:`coldset.analysis.speed.COLD_PATHS` (:mod:`coldset.reporting.cold_path`).
COLD_PATH_WORDS = {"in_place": "in place", "raw_fill": "raw fills", "compressed_fill": "compressed fills"}


def row_cold_path(policy: str, host_tier: str | None) -> str:
    """The cold path of one cache-simulation row: ``static`` reads in place, a dynamic cache fills
    its slots from its row's host tier (``raw`` where the table has no ``host_tier`` column)."""
    if policy == "static":
        return COLD_PATH_WORDS["in_place"]
    return COLD_PATH_WORDS["compressed_fill" if host_tier == "compressed" else "raw_fill"]


def cache_note(table, residency: str, pick: str | None = None) -> str | None:
    """What the cache simulation (``cache/{model}/simulation.csv``, a DataFrame) says at this
    residency for the smallest simulated batch: the runnable policy with the lowest simulated step
    (or, without the time columns, the highest hit rate) and its cold path (raw or compressed
    fills, :func:`row_cold_path`) against the static set (read in
    place); ``pick``: the speed model's cold path, added after. None without rows or at full
    residency (nothing to cache)."""
    if table is None or not len(table) or float(residency) >= 1:
        return None
    # belady knows the future: the simulation's bound, not a policy to choose
    rows = table[((table["residency"] - float(residency)).abs() < 1e-9) & (table["policy"] != "belady")]
    if "batch" in rows.columns and len(rows):
        rows = rows[rows["batch"] == rows["batch"].min()]
    if not len(rows):
        return None
    timed = "step_ms" in rows.columns and rows["step_ms"].notna().all()
    column, unit = ("step_ms", " ms simulated step") if timed else ("hit_rate", " hit rate")
    best = rows.loc[rows[column].idxmin() if timed else rows[column].idxmax()]
    static = rows[rows["policy"] == "static"]
    batch = f" at batch {int(best['batch'])}" if "batch" in rows.columns else ""
    path = row_cold_path(best["policy"], best.get("host_tier"))
    text = f"the cache simulation{batch}: {best['policy']} ({path}) best ({human(best[column])}{unit}"
    if len(static) and best["policy"] != "static":
        text += f"; the static set, read in place, {human(static[column].iloc[0])}"
    return text + ")" + (f"; {pick}" if pick else "")

