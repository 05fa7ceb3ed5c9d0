"""What a ``ringtrain run`` driver costs: its own CPU time and peak memory, and the whole run's,
side by side with a baseline tree (by default the commit before the driver stopped importing
torch: the store hosted in the driver, tensorboardX importing torch).

Each round runs, in turn, this tree's driver and the baseline's on the same script (2 workers,
3 reports with a TrainState checkpoint each, TensorBoard on: the defaults). Per run, measured
in the driver process by ``resource.getrusage``: the driver's own CPU seconds (user + system)
and peak RSS (MiB), the whole run's CPU seconds (the driver plus its children: the zygote, the
store, the reapers; forked workers are the zygote's children) and the wall time. Reported:
medians over ``--repeats`` rounds, and this tree's / the baseline's ratios.

    python benchmarks/driver_footprint.py                    # baseline: fc5e9a5, 5 rounds
    python benchmarks/driver_footprint.py --baseline HEAD~3 --repeats 3

The baseline is checked out with ``git worktree`` into a temporary directory and put first on
``PYTHONPATH`` (the installed ringtrain is this tree's, editable); it is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    """
    import torch
    import ringtrain as rt

    model = rt.prepare_model(torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = rt.TrainState(model=model, optimizer=opt)
    state.restore()
    while state.step < 3:
        loss = model(torch.randn(32, 16)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        state.step += 1
        rt.report({"loss": loss.item(), "step": state.step}, checkpoint=state)
    """
)

# Runs `ringtrain run` in this process (the driver) and prints what it cost, as JSON.
DRIVER = textwrap.dedent(
    """
    import json, resource, sys, time
    t0 = time.monotonic()
    from ringtrain.cli import main
    status = main(sys.argv[1:])
    wall = time.monotonic() - t0
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({
        "status": status,
        "torch": "torch" in sys.modules,
        "driver_cpu_s": me.ru_utime + me.ru_stime,
        "driver_rss_mib": me.ru_maxrss / 1024,
        "run_cpu_s": me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime,
        "wall_s": wall,
    }))
    """
)


def one_run(src: str | None, workdir: str, tag: str) -> dict[str, float]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    args = ["run", "-n", "2", "--name", tag, "--progress", "off", "--storage-path", workdir]
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, *args, os.path.join(workdir, "job.py")],
        env=env,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    record = json.loads(out.strip().splitlines()[-1])
    if record["status"] != 0:
        raise RuntimeError(f"{tag}: the run failed: {out}")
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="fc5e9a5", help="git revision of the baseline")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="rt-driver-footprint-")
    tree = os.path.join(tmp, "baseline")
    subprocess.run(
        ["git", "-C", ROOT, "worktree", "add", "--detach", "-q", tree, args.baseline], check=True
    )
    try:
        with open(os.path.join(tmp, "job.py"), "w") as f:
            f.write(SCRIPT)
        runs: dict[str, list[dict[str, float]]] = {"this tree": [], "baseline": []}
        for i in range(args.repeats):
            runs["this tree"].append(one_run(None, tmp, f"new{i}"))
            runs["baseline"].append(one_run(os.path.join(tree, "src"), tmp, f"old{i}"))
        keys = ["driver_cpu_s", "driver_rss_mib", "run_cpu_s", "wall_s"]
        med = {k: {t: statistics.median(r[k] for r in rs) for t, rs in runs.items()} for k in keys}
        print(f"{args.repeats} rounds, 2 workers, baseline {args.baseline}; medians")
        print(f"{'':18}{'this tree':>12}{'baseline':>12}{'ratio':>8}")
        for k in keys:
            new, old = med[k]["this tree"], med[k]["baseline"]
            print(f"{k:18}{new:12.2f}{old:12.2f}{new / old:8.2f}")
        for tag, rs in runs.items():
            print(
                f"{tag}: torch imported by the driver in {sum(r['torch'] for r in rs)} of {len(rs)}"
            )
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
