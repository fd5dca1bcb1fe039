"""A test helper: one config run on Ray with several actor counts and in process, every
final model compared bit for bit (the runtime's promise that results do not depend on
packing)."""
import pyarrow.parquet as pq
import torch

from raysim.config import load_config
from raysim.run import main
from raysim.testing import InProcessServer


def same_bits_on_ray_and_in_process(tmp_path, common: list, actor_counts: tuple) -> tuple[list, list]:
    """Run `common` on each number of actors (run directories a<n> in `tmp_path`) and in
    process; assert every final model has the same bits; return the models (Ray's, then the
    in-process one) and each Ray run's `client_update` rows."""
    models, rows = [], []
    for actors in actor_counts:
        name = f"a{actors}"
        assert main([*common, f"resources.num_actors={actors}", f"output_dir={tmp_path}", f"run_name={name}",
                     "--quiet"]) == 0
        models.append(torch.load(tmp_path / name / "model.pt", weights_only=True)["global"])
        rows.append([r for r in pq.read_table(tmp_path / name / "clients.parquet").to_pylist()
                     if r["method"] == "client_update"])
    torch.set_num_threads(1)
    mine = InProcessServer.from_config(load_config(overrides=common))
    mine.run()
    models.append(mine.algorithm.model.state_dict())
    for m in models[1:]:
        assert all(torch.equal(models[0][k], m[k]) for k in m)
    return models, rows
