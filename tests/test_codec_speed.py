"""The speed model's compressed fill against a brute-force timeline (one tick at a time: the link
carries one record at a time in order, the decoder decodes one expert at a time in order, each
only once its record has landed), and its choice of raw in-place reads, raw fills or compressed
fills against the brute-force times of all three."""

import itertools
import random

import pytest

from coldset.core.placement import PlacementError
from coldset.analysis.speed import COLD_PATHS, cold_path_choice, compressed_fill_s

GB = 1e9


def timeline_ticks(copy_ticks, decode_ticks):
    """Ticks until the last decode ends, simulated tick by tick (integer durations)."""
    copy_left, decode_left = list(copy_ticks), list(decode_ticks)
    t = 0
    while any(decode_left):
        landed = [c == 0 for c in copy_left]  # state at the start of the tick
        j = next((j for j, c in enumerate(copy_left) if c), None)
        if j is not None:
            copy_left[j] -= 1
        k = next((k for k, d in enumerate(decode_left) if d), None)
        if k is not None and landed[k]:
            decode_left[k] -= 1
        t += 1
    return t


def test_compressed_fill_time_is_the_brute_force_timeline():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 6)
        raw = [4 * rng.randint(1, 6) for _ in range(n)]  # GB; ratios in quarters keep ticks integer
        ratios = [rng.choice([0.25, 0.5, 0.75, 1.0]) for _ in range(n)]
        decode = rng.choice([1, 2, 4])  # GB/s; link 1 GB/s, so a tick is one second
        got = compressed_fill_s([b * GB for b in raw], ratios, 1.0, decode)
        want = timeline_ticks([int(r * b) for r, b in zip(ratios, raw)], [b // decode for b in raw])
        assert got == pytest.approx(want), (raw, ratios, decode)


@pytest.mark.parametrize("link,decode,ratio,reads", list(itertools.product([1.0, 4.0], [0.5, 2.0, 8.0],
                                                                            [0.5, 0.75, 1.0], [1, 3])))
def test_the_choice_is_the_fastest_brute_force_path(link, decode, ratio, reads):
    raw = [4, 8, 4]  # GB
    hbm = 16.0
    got = cold_path_choice([b * GB for b in raw], link, hbm, ratio, decode, reads=reads)
    total = sum(raw)
    hbm_reads = reads * total / hbm
    # brute force in ticks of 1/16 s: every duration here is a whole number of them
    tick = 16
    copies = [int(ratio * b / link * tick) for b in raw]
    decodes = [int(b / decode * tick) for b in raw]
    brute = {"in_place": reads * total / link, "raw_fill": total / link + hbm_reads,
             "compressed_fill": timeline_ticks(copies, decodes) / tick + hbm_reads}
    assert (got.in_place_s, got.raw_fill_s, got.compressed_fill_s) == pytest.approx(
        (brute["in_place"], brute["raw_fill"], brute["compressed_fill"]))
    assert got.choice == min(COLD_PATHS, key=lambda p: (brute[p], COLD_PATHS.index(p)))


def test_h200_bf16_picks_compressed_fills_when_the_decoder_outruns_the_link_and_in_place_when_not():
    """Qwen3-30B-A3B bf16 experts (9.4 MB), a layer's 8 misses, the H200's 51 GB/s link and 3.4 TB/s
    HBM, ratio 0.676: a decoder at 4x the link makes fills cheaper than reading in place; one at
    half the link cannot pay for itself."""
    expert = 3 * 2048 * 768 * 2
    fast = cold_path_choice([expert] * 8, 51.0, 3400.0, 0.676, 4 * 51.0)
    slow = cold_path_choice([expert] * 8, 51.0, 3400.0, 0.676, 0.5 * 51.0)
    assert fast.choice == "compressed_fill" and fast.compressed_fill_s < 0.8 * fast.in_place_s
    assert slow.choice == "in_place"


def test_bad_rates_are_refused_by_name():
    with pytest.raises(PlacementError, match="decode"):
        cold_path_choice([1.0], 1.0, 1.0, 0.7, 0.0)
    with pytest.raises(PlacementError, match="reads"):
        cold_path_choice([1.0], 1.0, 1.0, 0.7, 1.0, reads=0)
    with pytest.raises(PlacementError, match="expert_bytes"):
        cold_path_choice([], 1.0, 1.0, 0.7, 1.0)
