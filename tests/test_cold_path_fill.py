"""The listed compressed fill's copy beside its decode (coldset.kernels.triton_codec_fill): the first half
of the listed records is copied, then decoded in a launch whose first programs copy the second half, then
the second half is decoded. Under Triton's interpreter, for every count of filled rows (the halves
uneven, one empty), bitwise the raw tier's row copy; a half's copy stages only its own rows."""

from interpreter_helpers import run_interpreted

_INTERPRETED = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_codec_tier import adversarial_pools, bytes_of, names_of, raw_fill, slot_pools
from coldset.kernels.compressed_tier import compressed_host_tier
from coldset.kernels.triton_codec_fill import copy_records, fill_listed

host_rows, slots = [5, 1, 3], [2, 0, 1]  # the slot pools' three slots
all_hot = adversarial_pools()
tier = compressed_host_tier(all_hot, lane_symbols=64)
width = -(-tier.max_record_bytes // 16) * 16
for m in (1, 2, 3):
    want = slot_pools(all_hot)
    raw_fill(want, host_rows[:m], slots[:m])
    got = slot_pools(all_hot)
    staging = torch.full((3, width), 0xA5, dtype=torch.uint8)  # poisoned: a record not copied shows
    done = torch.full((all_hot.num_hot,), -1, dtype=torch.int64)
    ticket = torch.zeros(1, dtype=torch.int32)
    fill_listed(tier, got, torch.tensor(slots), torch.tensor(host_rows), torch.tensor(m), staging, blocks=1,
                tags=(torch.tensor([11, 12, 13]), done, ticket))
    for n, a, b in zip(names_of(want), bytes_of(want), bytes_of(got)):
        assert torch.equal(a, b), (m, n)
    assert done[slots[:m]].tolist() == [11, 12, 13][:m] and int(ticket) == 0, (m, done)
    # the halves: the first ceil(m / 2) rows, then the rest, each row staged by one half only
    split = (m + 1) // 2
    for half, rows in ((1, range(split)), (2, range(split, m))):
        staging.fill_(0xA5)
        copy_records(tier, torch.tensor(host_rows), torch.tensor(m), staging, 3, blocks=1, half=half)
        for j in range(3):
            rec = tier.data[tier.starts[host_rows[j]]:tier.starts[host_rows[j] + 1]]
            if j in rows:
                assert torch.equal(staging[j, :rec.numel()], rec), (m, half, j)
            else:
                assert bool((staging[j] == 0xA5).all()), (m, half, j)
print("INTERPRETED OK")
"""


def test_the_fill_copies_the_second_half_beside_the_first_halfs_decode_bitwise():
    run_interpreted(_INTERPRETED)
