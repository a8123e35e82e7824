"""Router post-training of a checkpoint bigger than memory, inside a memory cgroup: the runs of
results/train_big.json (issue 44). Each run is `expertcache train-cache-aware` with its experts streamed
(`train.memory_gb`), in a process of its own inside the cgroup; the bf16 checkpoint first, then (`--bits 4`) the
same checkpoint quantized (`expertcache quantize`'s writer).

    # bench big's 27-layer Qwen3-30B-A3B-shaped checkpoint (written once by bench big), an 8 GiB cgroup:
    nice -n 19 .venv/bin/python scripts/train_big.py --model runs/big/ckpt --corpus data/corpus \\
        --cgroup_gb 8 --memory_gb 7.5 --steps 8 --batch_size 1 --seq_len 256 --bits 4 --out results/train_big.json
    # a small one to try it: --make_layers 2 --model /tmp/big2 writes a 2-layer checkpoint of that shape first

The JSON: `commit`, `runs` (each: checkpoint, experts_bytes, memory_cgroup_bytes, trainable, steps,
tokens_per_step, tokens_per_s, bytes_read_per_step, disk_read_gbps (measured at the run's end, as the run reads),
roofline_tokens_per_s, peak_rss_bytes, cgroup_peak_bytes, loss_first, loss_last, completed), the host's memory.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from expertcache.telemetry.atomic import write_json

REPO = Path(__file__).resolve().parents[1]
FIELDS = ("checkpoint", "experts_bytes", "quant_bits", "trainable", "steps", "tokens_per_step", "tokens_per_s",
          "bytes_read_per_step", "disk_read_gbps", "roofline_tokens_per_s", "read_wait_s", "peak_rss_bytes",
          "loss_first", "loss_last", "completed", "floor_bytes", "memory_budget_bytes", "step_s", "step_read_bytes",
          "fit_tokens_per_s")


def run_one(ckpt: Path, out: Path, a, cg) -> dict:
    done = out / "run.json"
    if done.is_file():  # finished by an earlier invocation (its row as measured then): resumable, run by run
        return json.loads(done.read_text())
    args = ["train-cache-aware", "--recipe", "locality", f"base={ckpt}", f"out_dir={out}", f"data.corpus={a.corpus}",
            f"data.tokenizer={ckpt}", f"data.batch_size={a.batch_size}", f"data.seq_len={a.seq_len}",
            "data.val_batches=1", f"train.max_steps={a.steps}", "train.warmup_steps=1", "train.log_every=1",
            f"train.val_every={a.steps + 1}", f"train.ckpt_every={a.steps}", "train.wandb=false",
            f"train.memory_gb={a.memory_gb}", f"train.expert_tier={a.tier}", f"train.frozen_dtype={a.frozen_dtype}",
            "quality.trainable=routers",
            f"quality.distill={a.distill}", "locality.weight=1.0", "--resume", "false"]
    cmd = [sys.executable, "-c", "import sys; from expertcache.recipes.cli import main; sys.exit(main())", *args]
    if cg is not None:
        cg.reset_peak()
    p = subprocess.run(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                       preexec_fn=cg.preexec if cg is not None else None)
    row = {"memory_cgroup_bytes": cg.limit_bytes if cg is not None else None,
           "cgroup_peak_bytes": cg.peak_bytes() if cg is not None else None, "exit": p.returncode}
    res = out / "result.json"
    if p.returncode != 0 or not res.is_file():
        last = [ln for ln in p.stderr.splitlines() if ln.strip()][-1:] or [""]
        return {"checkpoint": str(ckpt), "completed": False, **row,
                "error": f"exit {p.returncode}" + (" (killed: out of memory in the cgroup?)" if p.returncode in
                                                   (-9, 137) else "") + f": {last[0][:300]}"}
    r = json.loads(res.read_text())
    out_row = {**{k: r.get(k) for k in FIELDS}, **row, "commit": a.commit}
    out_row["checkpoint"] = Path(out_row["checkpoint"]).name  # a folder name, not this machine's path
    write_json(done, out_row)
    trained = out / "model"  # the trained copy of a bigger-than-memory checkpoint: as large as the base; the
    if a.drop_model and trained.is_dir():  # figures are the run's, so it goes unless asked to keep it
        shutil.rmtree(trained)
    return out_row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="checkpoint folder (bf16)")
    ap.add_argument("--make_layers", type=int, default=0, help="first write bench big's checkpoint with this many "
                    "layers at --model (0: use --model as it is)")
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--work", default="runs/train-big", help="run folders (and the quantized checkpoint)")
    ap.add_argument("--memory_gb", type=float, default=7.5, help="train.memory_gb (the floor is checked)")
    ap.add_argument("--cgroup_gb", type=float, default=8.0, help="the memory cgroup (GiB; 0: none)")
    ap.add_argument("--tier", default="disk")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch_size", type=int, default=1)
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--distill", type=float, default=0.0, help="quality.distill (a third read pass per step)")
    ap.add_argument("--bits", type=int, default=0, help="also the run on the checkpoint quantized to 4 or 8 bits")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--frozen_dtype", default="fp32", choices=["fp32", "bf16"],
                    help="train.frozen_dtype: the frozen non-expert weights in fp32 or bf16 (routers stay fp32)")
    ap.add_argument("--runs", default=None, help="which runs: bf16 (the checkpoint as it is) and/or int4/int8 "
                    "(--bits); a run left out is not in the JSON (default: bf16, and int{--bits} with --bits)")
    ap.add_argument("--out", default="results/train_big.json")
    ap.add_argument("--drop_model", type=lambda s: s.lower() in ("1", "true", "yes"), default=True,
                    help="delete each run's trained checkpoint once measured (each is as large as the base)")
    a = ap.parse_args()
    from expertcache.telemetry.errors import InputError

    if a.bits not in (0, 4, 8):
        raise InputError(f"--bits {a.bits}: expected 4 or 8 (0: the bf16 run only)")
    if a.runs is None:
        a.runs = "bf16" + (f",int{a.bits}" if a.bits else "")
    which = {w.strip() for w in a.runs.split(",") if w.strip()}
    known = {"bf16", *([f"int{a.bits}"] if a.bits else [])}
    if not which or which - known:
        raise InputError(f"--runs {a.runs}: expected a subset of {','.join(sorted(known))} (int4/int8 need --bits)")
    for name in ("steps", "batch_size", "seq_len"):
        if getattr(a, name) < 1:
            raise InputError(f"--{name} {getattr(a, name)}: expected an integer >= 1")
    if not a.memory_gb > 0 or not a.cgroup_gb >= 0 or a.make_layers < 0:
        raise InputError(f"--memory_gb {a.memory_gb:g}, --cgroup_gb {a.cgroup_gb:g}, --make_layers {a.make_layers}: "
                         f"expected memory_gb > 0 (streamed experts), cgroup_gb >= 0 (0: no cgroup), make_layers >= 0")
    if not a.make_layers and not (Path(a.model) / "config.json").is_file():
        raise InputError(f"--model {a.model}: no checkpoint there (no config.json); --make_layers N writes bench "
                         f"big's checkpoint of N layers there first")
    if not Path(a.corpus).is_dir():
        raise InputError(f"--corpus {a.corpus}: no such folder (`expertcache corpus` or `make quickstart` builds one)")
    from expertcache.telemetry.atomic import check_output

    check_output(a.out)

    from expertcache.runtime.commands import _git_commit
    from expertcache.runtime.bench.memcg import MemoryCgroup

    commit = _git_commit(REPO / "runtime")
    a.commit = commit  # each run's row records the code it ran (a later invocation may reuse it)
    ckpt, work = Path(a.model), Path(a.work)
    if a.make_layers:
        from expertcache.runtime.bench.bigckpt import write_checkpoint

        write_checkpoint(ckpt, a.make_layers)
    cg, why = MemoryCgroup.create(int(a.cgroup_gb * 2 ** 30)) if a.cgroup_gb else (None, "not asked")
    runs = []
    try:
        if "bf16" in which:
            runs.append(run_one(ckpt, work / "bf16", a, cg))
        if a.bits and which - {"bf16"}:
            from expertcache.runtime.kernels import quant_write

            q = work / f"int{a.bits}-ckpt"
            if not (q / "config.json").is_file():  # written outside the cgroup, once
                quant_write.write_quantized(ckpt, q, a.bits, a.group)  # (the tokenizer files come along)
            runs.append(run_one(q, work / f"int{a.bits}", a, cg))
    finally:
        if cg is not None:
            cg.close()
    from expertcache.runtime.bench.bigckpt import physical_ram

    doc = {"commit": commit, "host_ram_bytes": physical_ram(), "cgroup": why or "memory cgroup", "runs": runs}
    failed = [r for r in runs if not r.get("completed")]
    for r in failed:
        print(f"train_big: the run on {r.get('checkpoint')} did not complete: {r.get('error', 'stopped early')}",
              file=sys.stderr)
    if failed and len(failed) == len(runs):  # nothing measured: the last result stays as it was
        print(f"train_big: no run completed; {a.out} not written", file=sys.stderr)
        return 1
    from expertcache.runtime.bench.results import write_result

    write_result(a.out, doc, config=vars(a))
    print(json.dumps(doc))
    return 1 if failed else 0


if __name__ == "__main__":
    from expertcache.telemetry.errors import run_script

    sys.exit(run_script(main))
