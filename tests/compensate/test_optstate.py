"""optstate.LayerStates: a layer's optimizer state comes back exactly as put, from memory or disk;
a stale file from a killed pass is never read."""

from __future__ import annotations

import torch

from laco_deploy.compensate.optstate import LayerStates


def test_round_trip_memory_and_disk(tmp_path):
    g = torch.Generator().manual_seed(0)
    states = {"q_proj.weight": {"step": torch.tensor(3.0), "exp_avg": torch.randn(8, 6, generator=g),
                                "exp_avg_sq": torch.rand(8, 6, generator=g)},
              "q_proj.bias": {"step": torch.tensor(3.0), "exp_avg": torch.ones(8)}}
    for folder in (None, tmp_path / "state"):
        store = LayerStates(folder)
        store.put(4, {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in states.items()})
        assert store.nbytes() == sum(v.numel() * 4 for s in states.values() for v in s.values())
        if folder is not None:
            assert (folder / "layer-4.pt").is_file()
        back = store.get(4, torch.device("cpu"))
        assert back.keys() == states.keys()
        for name in states:
            assert all(torch.equal(back[name][k], states[name][k]) for k in states[name])
        assert store.get(5, torch.device("cpu")) == {}  # a layer before its first step
        store.close()
        assert folder is None or not folder.exists()


def test_a_stale_state_from_a_killed_pass_is_not_read(tmp_path):
    folder = tmp_path / "state"
    folder.mkdir()
    torch.save({"q_proj.weight/step": torch.tensor(9.0)}, folder / "layer-0.pt")
    assert LayerStates(folder).get(0, torch.device("cpu")) == {}
