"""Silent data corruption: bit-identical replicas as a sensor (docs/fault-tolerance.md,
"Silent data corruption").

- :mod:`~ringtrain.integrity.fingerprint`: 64-bit fingerprints of a rank's parameters and
  optimizer state;
- :mod:`~ringtrain.integrity.replicas`: the worker plug-in that compares them across the
  replicas every ``FailureConfig.replica_check_every`` steps, and recomputes one rank's step on
  another every ``replay_check_every`` steps;
- :mod:`~ringtrain.integrity.inject`: bit flips on purpose, to verify the detector.

The driver side (which rank is named, the rollback, the exclusion) is
:mod:`ringtrain.controller.integrity`.
"""
