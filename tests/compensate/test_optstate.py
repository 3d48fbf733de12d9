"""optstate.LayerStates: a layer's optimizer state comes back exactly as put, from memory or disk,
stored as its kept entries only."""

from __future__ import annotations

import torch

from laco_deploy.compensate.optstate import LayerStates


def _state(mask: torch.Tensor) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"step": torch.tensor(3.0), "exp_avg": torch.randn(mask.shape, generator=g) * mask,
            "exp_avg_sq": torch.rand(mask.shape, generator=g) * mask}


def test_round_trip_memory_and_disk(tmp_path):
    mask = torch.rand(8, 6, generator=torch.Generator().manual_seed(1)) > 0.5
    states = {"q_proj.weight": _state(mask), "q_proj.bias": {"step": torch.tensor(3.0), "exp_avg": torch.ones(8)}}
    keep = {"q_proj.weight": mask, "q_proj.bias": None}
    for folder in (None, tmp_path / "state"):
        store = LayerStates(folder)
        store.put(4, {k: dict(v) for k, v in states.items()}, keep)
        full_bytes = sum(v.numel() * 4 for s in states.values() for v in s.values())
        assert store.nbytes() == full_bytes - 2 * int((~mask).sum()) * 4  # the pruned moments are not stored
        if folder is not None:
            assert (folder / "layer-4.pt").is_file()
        back = store.get(4, keep, torch.device("cpu"))
        assert back.keys() == states.keys()
        for name in states:
            assert all(torch.equal(back[name][k], states[name][k]) for k in states[name])
        assert store.get(5, keep, torch.device("cpu")) == {}  # a layer before its first step
        store.close()
        assert folder is None or not folder.exists()


def test_a_stale_state_from_a_killed_pass_is_not_read(tmp_path):
    folder = tmp_path / "state"
    folder.mkdir()
    torch.save({"q_proj.weight/step": torch.tensor(9.0)}, folder / "layer-0.pt")
    assert LayerStates(folder).get(0, {"q_proj.weight": None}, torch.device("cpu")) == {}
