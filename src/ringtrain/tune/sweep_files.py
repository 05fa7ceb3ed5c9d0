"""The files a sweep keeps in its directory besides the trials: ``tuner.json`` (what the sweep
is, for ``ringtrain ls`` and the dashboard), ``tuner.pkl`` (what :meth:`Tuner.restore
<ringtrain.tune.Tuner.restore>` needs: the train function, search space and configs, pickled
with cloudpickle and signed: ``tuner.pkl.sig``) and the Optuna study ``study.db``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ringtrain.config import RunConfig, ScalingConfig
from ringtrain.rundir import RunDirectory

if TYPE_CHECKING:
    from ringtrain.checkpoint.signing import Signer
    from ringtrain.tune.tune_config import TuneConfig

logger = logging.getLogger("ringtrain")

TUNER_FILE = "tuner.json"
TUNER_PAYLOAD = "tuner.pkl"
STUDY_FILE = "study.db"


@dataclass(frozen=True)
class SavedSweep:
    """What ``tuner.pkl`` holds (a dict with these keys in the file)."""

    train_fn: Callable[..., Any]
    param_space: Mapping[str, Any]
    tune_config: TuneConfig
    scaling_config: ScalingConfig
    run_config: RunConfig
    #: A trainer sweep's ``train_loop_config`` (``Tuner(TorchTrainer(...))``), else None.
    trainer_loop_config: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The dict that is pickled (shallow: the configs stay objects)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def write_sweep_files(
    sweep: RunDirectory, name: str, *, description: Mapping[str, Any], saved: SavedSweep
) -> None:
    """Write ``tuner.json`` (``description`` plus name, kind, version, creation time) and the
    signed ``tuner.pkl`` of ``saved`` into ``sweep``.

    The signing key, its file and the choice to trust unsigned data never go to storage.
    Callbacks that cannot be pickled are dropped from the stored run config (a warning).

    Raises:
        TypeError: ``train_fn`` or ``param_space`` cannot be pickled.
    """
    from ringtrain import __version__
    from ringtrain.checkpoint.signing import from_run_config
    from ringtrain.wire.payload import dumps

    sweep.write_json(
        TUNER_FILE,
        {
            "name": name,
            "kind": "sweep",
            "ringtrain_version": __version__,
            "created": time.time(),
            **description,
        },
    )
    signer = from_run_config(saved.run_config)
    run_config = dataclasses.replace(
        saved.run_config, signing_key=None, signing_key_file=None, trust_unsigned=False
    )
    payload = {**saved.as_dict(), "run_config": run_config}
    try:
        data = dumps(payload)
    except Exception as exc:  # e.g. a callback holding a socket
        logger.warning(
            "RunConfig.callbacks cannot be pickled (%s); Tuner.restore will run without them",
            exc,
        )
        payload["run_config"] = dataclasses.replace(run_config, callbacks=[])
        try:
            data = dumps(payload)
        except Exception as exc2:
            raise TypeError(
                "train_fn and param_space must be picklable (they are stored in the sweep "
                f"directory for Tuner.restore and shipped to the workers): {exc2}"
            ) from exc2
    sweep.write_bytes(TUNER_PAYLOAD, data)
    sweep.write_bytes(TUNER_PAYLOAD + ".sig", signer.sidecar(data, TUNER_PAYLOAD, name))


def load_saved_sweep(path: str, signer: Signer) -> tuple[SavedSweep, str, str]:
    """``(saved, name, storage_path)`` of the sweep directory ``path``: its ``tuner.pkl``,
    checked against ``signer`` before it is unpickled.

    Raises:
        FileNotFoundError: ``path`` is not a sweep directory (no ``tuner.pkl``).
        SignatureError (a ValueError): ``tuner.pkl`` is not signed for this sweep with the key.
    """
    import cloudpickle
    import fsspec

    from ringtrain.checkpoint.signing import SIG_SUFFIX
    from ringtrain.checkpoint.storage import is_local_fs

    fs, stripped = fsspec.core.url_to_fs(path)
    payload = stripped.rstrip("/") + "/" + TUNER_PAYLOAD
    if not fs.exists(payload):
        raise FileNotFoundError(f"{path} is not a sweep directory (no {TUNER_PAYLOAD})")
    parent, _, name = stripped.rstrip("/").rpartition("/")
    with fs.open(payload, "rb") as f:
        data = f.read()
    try:
        with fs.open(payload + SIG_SUFFIX, "rb") as f:
            sidecar = f.read()
    except FileNotFoundError:
        sidecar = None
    signer.check_sidecar(data, sidecar, TUNER_PAYLOAD, name, f"{path}/{TUNER_PAYLOAD}")
    saved = cloudpickle.loads(data)
    storage_path = os.path.abspath(parent) if is_local_fs(fs) else fs.unstrip_protocol(parent)
    fields = {f.name: saved[f.name] for f in dataclasses.fields(SavedSweep) if f.name in saved}
    return SavedSweep(**fields), name, storage_path
