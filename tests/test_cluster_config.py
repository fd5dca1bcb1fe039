"""cluster.yaml and cluster-onprem.yaml against Ray's own cluster-config schema (the
`ray-schema.json` the launcher validates with), after Ray fills in its provider defaults."""
import copy
import json
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-onprem.yaml"])
def test_cluster_config_is_valid_for_ray_up(name):
    config = yaml.safe_load((ROOT / name).read_text())
    # as written (the local provider's top-level `min_workers` is read, and taken out, by
    # `ray up` before it validates: Ray's local example config has it there too)
    jsonschema.validate({k: v for k, v in config.items() if k != "min_workers" or name == "cluster.yaml"}, SCHEMA)
    validate_config(prepare_config(copy.deepcopy(config)))  # as `ray up` prepares it
    head = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head  # the Dashboard is never opened to the world
    assert any("pip install" in c and "~/raysim" in c for c in config["setup_commands"])
    # token authentication on every node, from a token file the launcher copies there
    for c in config["head_start_ray_commands"] + config["worker_start_ray_commands"]:
        assert "ray stop" in c or "RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$HOME/.raysim/ray_token" in c, c
    assert config["file_mounts"]["~/.raysim/ray_token"] == "~/.raysim/ray_token"


def test_schema_rejects_a_misspelt_field():
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    config["max_workerz"] = 3
    with pytest.raises(jsonschema.ValidationError, match="max_workerz"):
        jsonschema.validate(config, SCHEMA)


def test_cloud_config_has_autoscaling_gpu_workers():
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    workers = [t for n, t in config["available_node_types"].items() if n != config["head_node_type"]]
    assert workers and all(t.get("min_workers", 0) == 0 and t["max_workers"] >= 1 for t in workers)
    assert config["available_node_types"][config["head_node_type"]]["resources"] == {"CPU": 0}


def test_onprem_min_workers_is_what_ray_up_starts_and_zero_leaves_the_workers_to_the_autoscaler():
    config = yaml.safe_load((ROOT / "cluster-onprem.yaml").read_text())
    node_type = lambda c: next(iter(prepare_config(copy.deepcopy(c))["available_node_types"].values()))  # noqa: E731
    assert node_type(config)["min_workers"] == len(config["provider"]["worker_ips"]) == config["max_workers"]
    config["min_workers"] = 0
    assert (node_type(config)["min_workers"], node_type(config)["max_workers"]) == (0, 2)
