"""``ringtrain tune SWEEP.py``: run the sweep a script defines.

The script is executed (not as ``__main__``, so its ``if __name__ == "__main__":`` block does not
run) and must define ``train_fn``, ``param_space`` and ``tune_config``; ``scaling_config`` and
``run_config`` are optional. Command-line options override the script's values.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import runpy
import sys

REQUIRED = ("train_fn", "param_space", "tune_config")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Returns 0 when at least one trial completed, 1 otherwise (2 for usage errors)."""
    import ringtrain as rt
    from ringtrain.tune import Tuner

    if args.resume:
        if args.script:
            parser.error("give either SCRIPT or --resume RUN, not both")
        try:
            tuner = Tuner.restore(args.resume)
        except FileNotFoundError as exc:
            parser.error(str(exc))
    else:
        if not args.script:
            parser.error("the sweep SCRIPT is required (or --resume RUN)")
        if not os.path.isfile(args.script):
            parser.error(f"no such sweep script: {args.script}")
        script_dir = os.path.dirname(os.path.abspath(args.script))
        sys.path.insert(0, script_dir)  # the script's own imports, as `python SCRIPT` would
        found = runpy.run_path(args.script, run_name="__ringtrain_tune__")
        missing = [k for k in REQUIRED if k not in found]
        if missing:
            parser.error(
                f"{args.script} must define {', '.join(REQUIRED)}; missing: {', '.join(missing)}"
            )
        scaling = found.get("scaling_config") or rt.ScalingConfig()
        run_config = found.get("run_config") or rt.RunConfig(
            name=os.path.splitext(os.path.basename(args.script))[0]
        )
        tune_config = found["tune_config"]
        try:
            if args.num_workers:
                scaling = dataclasses.replace(scaling, num_workers=args.num_workers)
            changes = {
                k: v
                for k, v in (
                    ("name", args.name),
                    ("storage_path", args.storage_path),
                    ("progress", args.progress),
                )
                if v is not None
            }
            run_config = dataclasses.replace(run_config, **changes)
            tchanges = {
                k: v
                for k, v in (
                    ("num_samples", args.num_samples),
                    ("max_concurrent_trials", args.max_concurrent_trials),
                )
                if v is not None
            }
            tune_config = dataclasses.replace(tune_config, **tchanges)
            tuner = Tuner(
                found["train_fn"],
                param_space=found["param_space"],
                tune_config=tune_config,
                scaling_config=scaling,
                run_config=run_config,
            )
        except (TypeError, ValueError) as exc:
            parser.error(str(exc))
    try:
        grid = tuner.fit()
    except ValueError as exc:
        print(f"ringtrain tune: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    done = [s for s in grid.statuses if s == "COMPLETE"]
    if not done:
        print("ringtrain tune: no trial completed", file=sys.stderr)
        return 1
    best = grid.get_best_result()
    print(f"best trial: {best.path}")
    print(f"  config: {best.config}")
    print(f"  {grid.metric}: {best.metrics.get(grid.metric)}")
    return 0
