"""One campaign run's driver process: ``python -m ringtrain.chaos.driver SPEC.json``.

``SPEC.json`` (written by the campaign) says either ``{"mode": "start", "payload": PATH, ...}``:
start the run with ``Trainer(fn, scaling_config, run_config).fit()``, the train function and its
config being the campaign's own cloudpickle file ``PATH`` (outside the run directory); or
``{"mode": "resume", "run_path": RUN}``: continue the run after its driver was killed, as a user
would, with ``Trainer.restore(RUN).fit()``. The outcome (the run's error, or null) goes to
``SPEC["outcome"]`` as JSON; the exit code is 0 when the run finished, 1 when it failed.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    import ringtrain as rt

    with open(argv[0]) as f:
        spec = json.load(f)
    if spec["mode"] == "resume":
        trainer = rt.Trainer.restore(spec["run_path"])
    else:
        import cloudpickle

        with open(spec["payload"], "rb") as pf:
            train_fn, config = cloudpickle.loads(pf.read())
        trainer = rt.Trainer(
            train_fn,
            rt.ScalingConfig(**spec["scaling_config"]),
            rt.RunConfig(
                name=spec["name"],
                storage_path=spec["storage_path"],
                failure_config=rt.FailureConfig(**spec["failure_config"]),
                progress="off",
                monitor_config=rt.MonitorConfig(tensorboard=False, csv=False),
            ),
            train_loop_config=config,
        )
    result = trainer.fit(raise_on_error=False)
    error = None if result.error is None else str(result.error)
    failures = [
        {"attempt": f.attempt, "rank": f.rank, "kind": f.kind, "message": f.message}
        for f in result.failures
    ]
    with open(spec["outcome"], "w") as f:
        json.dump({"error": error, "failures": failures}, f)
    return 0 if error is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
