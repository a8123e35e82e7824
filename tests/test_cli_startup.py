"""The command line starts without the heavy libraries (#46: `expertcache --help` took 6.4 s importing lightning,
torch and transformers to list the commands)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from expertcache.recipes import cli

HEAVY = ("torch", "transformers", "lightning", "lm_eval.models.huggingface", "numba", "pyarrow")


def _heavy_after(code: str) -> list[str]:
    """The heavy modules a fresh interpreter holds after running `code` (SystemExit from --help is expected)."""
    probe = (f"import sys\ntry:\n    {code}\nexcept SystemExit:\n    pass\n"
             f"print('heavy:' + ','.join(m for m in {HEAVY!r} if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("heavy:"), r.stdout
    return [m for m in line[len("heavy:"):].split(",") if m]


def test_importing_the_cli_imports_no_heavy_library():
    assert _heavy_after("import expertcache.recipes.cli") == []


def test_the_whole_tools_help_imports_no_heavy_library(capsys):
    assert _heavy_after("from expertcache.recipes.cli import main; main(['--help'])") == []


def test_a_missing_or_unknown_command_is_one_line_and_exit_2_without_heavy_imports(capsys):
    assert _heavy_after("from expertcache.recipes.cli import main; sys.exit(main(['no-such-command']))") == []
    assert cli.main(["no-such-command"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no-such-command" in err[0] and "eval" in err[0]
    assert cli.main([]) == 2


def test_the_summary_lists_each_command_as_its_own_parser_does():
    """The help read from the sources with ast is what the imported functions' docstrings say."""
    parsers: dict = {}
    cli.build_parser(parsers, only="analyze")
    cli.build_parser(parsers, only="trace")
    summary = cli.summary_parser()
    choices = summary._subcommands_action.choices
    assert list(choices) == list(cli.COMMANDS)
    helps = {a.dest: a.help for a in summary._subcommands_action._choices_actions}
    fn = parsers["analyze", None][0]
    assert helps["analyze"] == cli._first_line(fn) and helps["analyze"].startswith("Reuse, coverage")
    assert helps["trace"] == "record, import"
    assert cli._docstring(cli.COMMANDS["eval"]).startswith("lm-eval tasks and the step-wise")


@pytest.mark.parametrize("argv", [["quickstart"], ["train-cache-aware"], ["pretrain"], ["data", "build"]])
def test_a_recipe_commands_help_imports_no_heavy_library(argv):
    """The recipe commands' --help took 4-5 s: jsonargparse resolved TrainSpec, DataSpec... in modules that import
    Lightning and torch; they live in trainer/specs.py now."""
    assert _heavy_after(f"from expertcache.recipes.cli import main; main({argv + ['--help']!r})") == []


def test_a_recipe_commands_help_still_lists_the_recipes_keys(capsys):
    """What the torch-free specs give jsonargparse is the whole recipe: every section's keys, with their help."""
    with pytest.raises(SystemExit):
        cli.main(["train-cache-aware", "--help"])
    out = capsys.readouterr().out
    for key in ("--recipe.locality.kind", "--recipe.train.lr", "--recipe.data.seq_len", "--recipe.eval.capacities",
                "--recipe.routers.spatio"):
        assert key in out, key
    with pytest.raises(SystemExit):
        cli.main(["pretrain", "--help"])
    out = capsys.readouterr().out
    assert "--recipe.model.num_layers" in out and "decoder layers, every one a MoE layer" in out


def test_the_quick_exit_keeps_what_a_normal_exit_does():
    """`exit_now` (the console scripts' way out, skipping the interpreter's module teardown) still waits for a
    non-daemon thread, runs the atexit handlers, flushes a large buffered stdout into a pipe and exits with the
    status given; an idle thread pool still referenced from a cycle (the engine's readers) does not keep it waiting
    forever (a join of every thread did); a stdout that cannot take the output is exit 120, not a success; under a
    profiler it leaves the normal way (cProfile writes its file)."""
    code = ("import atexit, threading, time, concurrent.futures as cf\n"
            "from expertcache.recipes.cli import exit_now\n"
            "atexit.register(lambda: print('atexit ran'))\n"
            "threading.Thread(target=lambda: (time.sleep(0.2), print('thread done'))).start()\n"
            "class Engine: pass\n"
            "e = Engine(); e.me = e; e.pool = cf.ThreadPoolExecutor(2); e.pool.submit(time.sleep, 0.01).result()\n"
            "print('x' * 200000)\n"
            "exit_now(3)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    lines = p.stdout.splitlines()
    assert p.returncode == 3 and lines == ["x" * 200000, "thread done", "atexit ran"], (p.returncode, p.stderr)
    full = "from expertcache.recipes.cli import exit_now\nprint('{}' * 1000)\nexit_now(0)\n"  # under the buffer: the exit's flush fails
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as a user's shell has it
    with open("/dev/full", "w") as out:
        p = subprocess.run([sys.executable, "-c", full], stdout=out, stderr=subprocess.PIPE, text=True, timeout=60,
                           env=env)
    assert p.returncode == 120 and "could not be written" in p.stderr, (p.returncode, p.stderr)


def test_the_quick_exit_steps_aside_for_a_profiler(tmp_path):
    """`python -m cProfile -o FILE -m expertcache.recipes.cli ...` writes its profile: the quick exit would skip
    what runs after the program."""
    prof = tmp_path / "p.prof"
    p = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "expertcache.recipes.cli",
                        "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and prof.stat().st_size > 0, p.stderr
