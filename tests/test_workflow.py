"""The researcher workflow (issue 15): partition pictures, plots, tables, sweeps."""
import numpy as np
import pytest

from raysim.run import main


def test_the_partition_picture_for_one_class_per_client_is_drawn(tmp_path, capfd):
    from raysim.config import load_config
    from raysim.data.partition import label_counts
    from raysim.experiment import prepare

    for suffix in ("png", "svg"):
        out = tmp_path / f"part.{suffix}"
        assert main(["--show-partition", "partition=classes", "partition.k=1", "--plot", str(out), "--quiet"]) == 0
        data = out.read_bytes()
        assert len(data) > 10_000
        assert data[:8] == b"\x89PNG\r\n\x1a\n" if suffix == "png" else b"<svg" in data[:2000]
    data, part, n = prepare(load_config(overrides=["partition=classes", "partition.k=1"]))
    counts = label_counts(data.y_train, part, n)  # what the picture draws: one label per client
    assert ((counts > 0).sum(1) == 1).all()


@pytest.mark.parametrize("args, says", [
    (["--show-partition", "--plot", "p.jpg"], "--plot p.jpg: the file must end in .png or .svg"),
    (["--plot", "p.png"], "--plot FILE draws the partition: give it with --show-partition"),
])
def test_a_bad_plot_request_gets_one_line(tmp_path, capfd, args, says):
    assert main([*args, "--quiet"]) == 2
    err = capfd.readouterr().err
    assert says in err and err.count("\n") == 1
