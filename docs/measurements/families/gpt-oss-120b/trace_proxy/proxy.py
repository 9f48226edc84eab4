"""gpt-oss-120b's b1 cache on the H200, x all-HBM, with the hit rates a real trace's routing gives.

Why: no gpt-oss routing trace is here, and random weights route with no forecastable structure. The
real Maverick trace (../shared/data/traces, top-1 of 128, 24 MoE layers) replayed at gpt-oss-120b's
expert bytes gives each policy's hit rate at each residency; this scales its misses to gpt-oss's
144 selections a token (36 layers x top-4), each miss waiting for its copy (no overlap):
x = T / (T + 144 (1 - hit) * bytes / link). T, the link and the bytes are the H200 run's
(BENCHMARKS section 12). An assumption, said beside the numbers: the hit rate carries from top-1
over 24 layers to top-4 over 36.

Usage: python proxy.py maverick_at_gptoss120b.csv
"""

import csv
import sys

T_MS, LINK_GBPS, EXPERT_BYTES, SELECTIONS = 4.03, 51.3, 13236480, 36 * 4

copy_ms = EXPERT_BYTES / LINK_GBPS / 1e6
print(f"copy {copy_ms:.3f} ms; all-HBM step {T_MS} ms; {SELECTIONS} selections a token")
print("residency,policy,hit_rate,misses_per_token,x_all_hbm")
for row in csv.DictReader(open(sys.argv[1])):
    if row["batch"] != "1":
        continue
    hit = float(row["hit_rate"])
    misses = SELECTIONS * (1 - hit)
    print(f"{row['residency']},{row['policy']},{hit:.4f},{misses:.2f},{T_MS / (T_MS + misses * copy_ms):.3f}")
