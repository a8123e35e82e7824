"""expertcache: Mixture-of-Experts inference when fast memory cannot hold every expert.

Areas: `expertcache.telemetry` (routing traces, cache analysis), `expertcache.runtime` (the offload engine, generate,
serve), `expertcache.trainer` (cache-aware post-training), `expertcache.evals` (lm-eval and the quality gate),
`expertcache.recipes` (the `expertcache` CLI).

Importing the package registers the lm-eval model `expertcache` (lazily: lm-eval and torch load only when a model
of that name is asked for), so after `import expertcache`

    lm_eval.simple_evaluate(model="expertcache", model_args={"pretrained": "runs/x/model"}, tasks=[...])

works. lm-eval's own command line cannot find it: `lm_eval --model expertcache` fails with "no model for this name
found", because lm-eval 0.4 offers installed packages no registration (no entry-point group; its registry holds
its own models and whatever the running process registered). Its command line with this package imported first is
one line (the arguments are lm-eval's own):

    python -c 'import expertcache, lm_eval.__main__ as m; m.cli_evaluate()' --model expertcache \
        --model_args pretrained=CKPT,capacity=0.25,miss=reroute --device cpu --tasks TASKS

(`--device cpu` on a machine without CUDA: lm-eval's command line passes `cuda:0` otherwise)

or use `expertcache eval` (lm-eval plus the step-wise perplexity, the gate's inputs), or `lm_eval --model
local-completions` against `expertcache serve`.
"""

__all__ = ["__version__"]

try:
    from importlib.metadata import version as _version

    __version__ = _version("expertcache")
except Exception:  # noqa: BLE001 - a source tree without an installed distribution
    __version__ = "0+unknown"


def _register_lm_eval() -> None:
    """`expertcache` in lm-eval's model registry as a lazy placeholder (no import of lm-eval's models or torch)."""
    try:
        import lm_eval.models  # noqa: F401 - lm-eval fills its registry only when it is empty at first lookup
        from lm_eval.api.registry import model_registry
    except Exception:  # noqa: BLE001 - lm-eval absent or of another API: nothing to register with
        return
    try:
        model_registry.register("expertcache", target="expertcache.evals.lm:ExpertCacheLM")
    except Exception:  # noqa: BLE001 - already registered (the class itself was imported first)
        pass


_register_lm_eval()
