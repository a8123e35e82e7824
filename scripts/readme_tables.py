"""Print the README's result tables from the committed results (so every figure there can be regenerated).

    python scripts/readme_tables.py            # all of them, markdown, in README order
"""

import json
from pathlib import Path

from expertcache.runtime import bench, bigbench, replay
from expertcache.trainer.cache_aware import frontier_table

RESULTS = Path(__file__).resolve().parents[1] / "results"
TABLES = [("bench_big.json", bigbench.table), ("bench_big_16gb.json", bigbench.table),
          ("bench_decode_0.87gb.json", bench.table), ("replay_bf16.json", replay.table)]

for name, fn in TABLES:
    p = RESULTS / name
    if p.is_file():
        print(f"<!-- results/{name} (git {json.loads(p.read_text()).get('git_commit', '?')}) -->")
        print(fn(json.loads(p.read_text())), end="\n\n")
if (RESULTS / "frontier.json").is_file():  # the post-training frontier (a list of rows)
    print("<!-- results/frontier.json (train-cache-aware --recipe frontier) -->")
    print(frontier_table(json.loads((RESULTS / "frontier.json").read_text())), end="\n\n")
