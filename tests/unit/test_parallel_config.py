"""ParallelConfig and the mesh's shape (issue 22): invalid meshes are refused before any process
starts, with the field and the fix named; the resolved shape travels in WorkerConfig."""

from __future__ import annotations

import pytest

import ringtrain as rt
from ringtrain.cluster.mesh import mesh_shape
from ringtrain.config.parallel import MESH_DIMS, MeshShape
from ringtrain.wire.worker_config import build_worker_config


def test_defaults_resolve_to_fsdp_over_every_rank() -> None:
    assert rt.ParallelConfig().resolve(4) == MeshShape(dp_shard=4)
    assert mesh_shape(None, 3) == MeshShape(dp_shard=3)
    shape = rt.ParallelConfig(dp_replicate=2, dp_shard=2, tp=2).resolve(8)
    assert shape.sizes == (1, 2, 2, 2) and shape.dp_size == 4 and shape.world_size == 8
    assert rt.ParallelConfig(dp_shard=2, tp=-1).resolve(8).tp == 4


def test_coordinates_are_row_major_with_tp_innermost() -> None:
    shape = MeshShape(pp=2, dp_replicate=1, dp_shard=2, tp=2)
    assert [shape.coordinates(r)["tp"] for r in range(8)] == [0, 1] * 4
    assert [shape.coordinates(r)["pp"] for r in range(8)] == [0] * 4 + [1] * 4
    # TP and PP peers share the data-parallel rank; dp ranks cover [0, dp_size).
    assert [shape.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    hsdp = MeshShape(dp_replicate=2, dp_shard=2)
    assert [hsdp.dp_rank(r) for r in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="outside a mesh of 8"):
        shape.coordinates(8)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tp": 0}, ValueError, r"ParallelConfig\.tp must be >= 1, or -1"),
        ({"pp": -2}, ValueError, r"ParallelConfig\.pp must be >= 1"),
        ({"tp": 2.0}, TypeError, r"ParallelConfig\.tp must be an int"),
        ({"dp_shard": True}, TypeError, r"ParallelConfig\.dp_shard must be an int"),
        ({"dp_shard": -1, "tp": -1}, ValueError, r"at most one field may be -1"),
    ],
)
def test_bad_fields_name_the_field(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        rt.ParallelConfig(**kwargs)


def test_the_product_must_equal_num_workers_before_any_process_starts() -> None:
    with pytest.raises(ValueError, match=r"= 12 must equal num_workers=8 \(use num_workers=12"):
        rt.ScalingConfig(
            num_workers=8, parallel=rt.ParallelConfig(dp_replicate=2, dp_shard=2, tp=3)
        )
    with pytest.raises(ValueError, match=r"multiply to 3, which does not divide num_workers=4"):
        rt.ScalingConfig(num_workers=4, parallel=rt.ParallelConfig(tp=3))
    with pytest.raises(TypeError, match=r"ScalingConfig\.parallel must be a ringtrain"):
        rt.ScalingConfig(num_workers=4, parallel="tp=2")  # type: ignore[arg-type]


def test_elastic_and_cross_node_tp_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match=r"elastic resizing of a device mesh is not supported"):
        rt.ScalingConfig(num_workers=(2, 4), parallel=rt.ParallelConfig(tp=2))
    with pytest.raises(ValueError, match=r"tensor parallelism must stay within a node"):
        rt.ScalingConfig(
            num_workers=4,
            use_gpu=True,
            backend="ray",
            placement_strategy="STRICT_SPREAD",
            parallel=rt.ParallelConfig(tp=2),
        )


def test_the_resolved_shape_travels_in_worker_config_and_config_json() -> None:
    scaling = rt.ScalingConfig(num_workers=4, parallel=rt.ParallelConfig(dp_shard=2, tp=2))
    config = build_worker_config(scaling, rt.RunConfig())
    assert config.mesh == MeshShape(dp_shard=2, tp=2)
    assert build_worker_config(rt.ScalingConfig(num_workers=2), rt.RunConfig()).mesh is None
    as_json = scaling.to_dict()
    assert as_json["parallel"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1}
    assert rt.ScalingConfig(**as_json) == scaling  # config.json round trip
    assert tuple(MESH_DIMS) == ("pp", "dp_replicate", "dp_shard", "tp")


def test_the_cli_flag_parses_and_refuses_a_bad_mesh_before_starting(tmp_path, capsys) -> None:
    from ringtrain.cli import main as cli_main

    assert rt.ParallelConfig.parse("dp_shard=2, tp=2") == rt.ParallelConfig(dp_shard=2, tp=2)
    assert rt.ParallelConfig.parse("dp-replicate=2,dp_shard=-1").dp_replicate == 2
    with pytest.raises(ValueError, match=r"'tp2' is not NAME=SIZE"):
        rt.ParallelConfig.parse("tp2")
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    argv = ["run", "-n", "4", "--parallel", "dp_shard=2,tp=3", "--storage-path", str(tmp_path)]
    with pytest.raises(SystemExit) as exc:
        cli_main([*argv, str(script)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "= 6 must equal -n/--num-workers 4" in err and not (tmp_path / "train").exists()
