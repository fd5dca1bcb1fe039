"""Client state kept by the server (runtime/state_store.py, issue 58): in memory up to a
budget, the rest in a file; what comes back is what went in, and runs give the same
models whether their states were in memory or on disk, on any number of actors, and
resumed from a checkpoint."""
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from raysim.run import main
from raysim.runtime import state_store
from raysim.runtime.state_store import ClientStates
from raysim.wire import Packed


def _state(rng, n):
    return {"w": Packed(rng.standard_normal((n, 7)).astype(np.float32)), "step": int(n)}


def _same(a, b):
    return a.keys() == b.keys() and np.array_equal(a["w"].array, b["w"].array) and a["step"] == b["step"]


def test_states_beyond_the_budget_go_to_a_file_and_come_back_exactly(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    store = ClientStates(memory_bytes=10 * 28 * 20, folder=tmp_path)  # about 10 states of 20 rows
    kept = {}
    for cid in range(60):
        kept[cid] = _state(rng, 20)
        store.put(cid, kept[cid])
    assert store.on_disk >= 45 and len(store) == 60
    files = list(tmp_path.glob("run-*/states.bin"))
    assert len(files) == 1
    for cid in (3, 17, 59, 0):  # rewritten: in memory again, the old bytes garbage
        kept[cid] = _state(rng, 5 + cid)
        store.put(cid, kept[cid])
    assert all(_same(store.get(c), kept[c]) for c in range(60))
    assert store.cids() == list(range(60))
    monkeypatch.setattr(state_store, "COMPACT_BYTES", 0)  # garbage over half the file: rewritten at the next spill
    for cid in [*range(5, 45)] * 2:
        kept[cid] = _state(rng, 20)
        store.put(cid, kept[cid])
    assert store.compactions >= 1 and files[0].stat().st_size == store._end <= 2 * store.disk_bytes
    assert all(_same(dict(s), kept[c]) for c, s in store.items())
    store.close()
    assert not list(tmp_path.iterdir())  # the file and its folder
    # a killed run's folder (its process gone) is removed by the next run that spills
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f"run-{int(dead.stdout)}-{socket.gethostname()}-abc"
    elsewhere = tmp_path / f"run-{int(dead.stdout)}-another-host-abc"  # a shared cache: not this host's to judge
    for folder in (orphan, elsewhere):
        folder.mkdir()
        (folder / "states.bin").write_bytes(b"x" * 100)
    again = ClientStates(memory_bytes=0, folder=tmp_path)
    again.put(1, _state(rng, 3))
    again.put(2, _state(rng, 3))
    assert again.on_disk == 1 and not orphan.exists() and elsewhere.exists()
    again.close()


def test_a_big_call_goes_in_pieces_dealt_in_turn_with_groups_whole():
    from raysim.runtime.placement import waves

    cost = {c: 10.0 for c in range(10)}
    cost[4] = 35.0  # bigger than a piece: alone
    got = waves([9, 8, 7, 6, 5, 4, 3, 2, 1, 0], cost, 3, 30.0)
    assert [chunk for _, chunk, _ in got] == [[0, 1, 2], [3], [4], [5, 6, 7], [8, 9]]
    assert [a for a, _, _ in got] == [0, 1, 2, 0, 1] and all(b is None for *_, b in got)
    grouped = waves(list(range(10)), dict.fromkeys(range(10), 10.0), 2, 45.0, vector_group=4)
    assert [(a, chunk, b) for a, chunk, b in grouped] == [(0, [0, 1, 2, 3], [4]), (1, [4, 5, 6, 7], [4]), (0, [8, 9], [2])]


def test_an_array_that_maps_a_read_only_buffer_is_copied(tmp_path):
    buffer = np.arange(12, dtype=np.float32)
    buffer.flags.writeable = False
    view = buffer[2:8]
    store = ClientStates(memory_bytes=2**20, folder=tmp_path)
    store.put(1, {"w": Packed(view)})
    got = store.get(1)["w"].array
    assert np.array_equal(got, view) and got.base is None and got.flags.writeable


@pytest.mark.parametrize("algorithm", ["scaffold", "fedper"])
def test_states_on_disk_give_the_models_of_states_in_memory_on_any_actors_and_resumed(ray_local, tmp_path,
                                                                                    algorithm):
    common = [f"algorithm={algorithm}", "dataset=digits", "model=mlp", "num_clients=12", "participation=0.5",
              "local.epochs=1", "checkpoint_every=2", f"output_dir={tmp_path}", "--quiet"]
    if algorithm == "fedper":
        common.append("partition.test_fraction=0.2")
    assert main([*common, "rounds=4", "resources.num_actors=1", "run_name=memory"]) == 0
    # every state but the last written on disk, three actors, and stopped after round 2 then resumed
    # (and each actor's clients in up to 3 tasks, as a store too small for a call's states splits them)
    disk = [*common, "resources.client_state_gb=0", "resources.num_actors=3", "resources.tasks_per_actor=3"]
    assert main([*disk, "rounds=2", "run_name=disk"]) == 0
    assert main([f"resume={tmp_path / 'disk'}", "rounds=4", "resources.client_state_gb=0", "--quiet"]) == 0
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True) for n in ("memory", "disk"))
    for part in a:
        if isinstance(a[part], dict):
            assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    on_disk = re.search(r"client states: (\d+) kept by the server, (\d+) of them on disk",
                        (tmp_path / "disk" / "log.txt").read_text())
    assert on_disk and int(on_disk.group(2)) == int(on_disk.group(1)) - 1 > 0
    assert re.search(r"client states: \d+ kept by the server, 0 of them on disk", (tmp_path / "memory" / "log.txt").read_text())
    # a round in pieces of one client each (resources.wave_mb below any update), dealt to two actors in turn
    assert main([*common, "rounds=4", "resources.num_actors=2", "resources.wave_mb=0.0001", "run_name=waves"]) == 0
    c = torch.load(tmp_path / "waves" / "model.pt", weights_only=True)
    for part in a:
        if isinstance(a[part], dict):
            assert all(torch.equal(a[part][k], c[part][k]) for k in a[part]), part
    assert re.search(r"round 1: 6 clients' updates and states \(.*\) go in 6 pieces", (tmp_path / "waves" / "log.txt").read_text())
    spill = state_store.spill_folder()
    assert not [p for p in spill.iterdir()], list(spill.iterdir())  # each run removed its file
    assert os.environ["RAYSIM_CACHE_DIR"] in str(spill)


def test_a_task_carries_at_most_a_sixteenth_of_the_object_store_in_client_state():
    from raysim.runtime.dispatch import tasks_for_states

    assert tasks_for_states(0, 2**30) == 1
    assert tasks_for_states(2**30 // 16, 2**30) == 1
    assert tasks_for_states(2**30 // 16 + 1, 2**30) == 2
    assert tasks_for_states(327 * 2**20, 0.3 * 2**30) == 18  # 1,500 of Ditto's MLPs, a 0.3 GB store
