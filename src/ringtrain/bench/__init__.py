"""``ringtrain bench``: the scaling report (throughput, speedup, efficiency, what limits them).

* :mod:`ringtrain.bench.analysis`: pure functions from timing windows and allreduce times to
  S(W), E(W), the Amdahl fit, the alpha-beta allreduce model, its prediction and conclusions.
* :mod:`ringtrain.bench.allreduce`: the short allreduce measurement job.
* :mod:`ringtrain.bench.report`: ``scaling.json``, ``scaling.html`` and its PNG charts.
* :mod:`ringtrain.bench.runner`: runs a script at each worker count (``ringtrain bench``).

See docs/scaling.md.
"""
