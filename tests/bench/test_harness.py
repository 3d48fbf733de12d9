"""The shared benchmark harness: token plan, scoring and the measurement loop, with a fake runtime."""

from __future__ import annotations

import math

import numpy as np
import pytest

from laco_deploy.bench import harness
from laco_deploy.config import BenchConfig, to_dict
from laco_deploy.errors import ConfigError
from laco_deploy.runtimes import cpu

VOCAB = 7


class FakeSession:
    """Uniform logits: every token has probability 1/VOCAB, so perplexity is VOCAB."""

    def __init__(self, log: list[str]):
        self.log = log

    def prefill(self, ids):
        self.log.append(f"prefill {len(ids)}")
        return np.zeros(VOCAB, np.float32)

    def step(self, token):
        self.log.append("step")
        return np.zeros(VOCAB, np.float32)

    def window_logits(self, ids):
        self.log.append(f"window {len(ids)}")
        return np.zeros((len(ids), VOCAB), np.float32)

    def metadata(self):
        return {"laco_deploy.pattern": "2:4", "general.name": "fake"}

    def facts(self):
        return {"fake": True}

    def close(self):
        self.log.append("close")


class FakeAdapter:
    def __init__(self):
        self.log: list[str] = []

    def load(self, job):
        self.log.append("load")
        return FakeSession(self.log)

    def tokens(self, session, job, cfg):
        return harness.plan_tokens([i % VOCAB for i in range(200)], None, cfg)


def test_plan_tokens_windows_bos_and_prompt():
    cfg = BenchConfig(n_prompt=10, ppl_ctx=16, ppl_windows=8)
    plan = harness.plan_tokens([0] + list(range(1, 40)), 0, cfg)  # BOS id 0 first
    assert len(plan["windows"]) == 2 and all(len(w) == 16 and w[0] == 0 for w in plan["windows"])
    assert plan["windows"][1][1:] == list(range(17, 32))
    assert plan["prompt"] == list(range(1, 11))  # BOS not part of the prompt text
    short = harness.plan_tokens(list(range(16)), None, BenchConfig(n_prompt=20, ppl_ctx=16))
    assert short["prompt"] == list(range(16)) + [0, 1, 2, 3]  # short text repeated
    with pytest.raises(ConfigError, match="fewer than one window"):
        harness.plan_tokens([1, 2], None, BenchConfig(ppl_ctx=16))


def test_measure_runs_every_runtime_through_the_same_loop():
    cfg = BenchConfig(repetitions=3, n_prompt=20, n_gen=5, ppl_ctx=32, ppl_windows=4)
    adapter = FakeAdapter()
    m = harness.measure(adapter, {"cfg": to_dict(cfg)})
    log = adapter.log
    assert log.count("load") == 3 and log[:6] == ["load", "close", "load", "close", "load", "prefill 16"]
    assert log.count("step") == 4 + 3 * 5  # warm-up 4 tokens, then n_gen per repetition
    assert log.count("window 32") == 4 and log[-1] == "close"
    assert m["ppl"] == pytest.approx(VOCAB) and m["ppl_tokens"] == 4 * 15 and m["ppl_windows"] == 4
    for key in ("pp_tps", "tg_tps", "ttft_s", "load_s"):
        assert set(m[key]) == {"median", "spread"} and m[key]["median"] > 0
    assert m["pattern"] == "2:4" and m["laco_deploy"] == {"pattern": "2:4"} and m["fake"] is True
    assert m["peak_rss_mib"] >= m["base_rss_mib"] > 0


def test_facts_and_notes():
    assert 1 <= cpu.physical_cores() and cpu.cpu_name()
    assert math.isnan(harness.rss_mib("NoSuchField"))
    assert harness.stat([1.0, 3.0, 2.0]) == {"median": 2.0, "spread": 1.0}
    notes = harness.sparsity_notes({"d": {"pattern": None}, "s": {"pattern": "2:4"}, "t": {"pattern": "structured"}}, "rt")
    assert len(notes) == 1 and notes[0].startswith("s: 2:4 sparsity") and "rt does the same work" in notes[0]
    env = harness.environment(2, "cpu", extra=1)
    assert env["threads"] == 2 and env["extra"] == 1 and "load_avg_1m" in env


def test_adapter_modules_keep_no_measurement_code():
    """Timing, RSS, statistics and scoring live in the harness only (CPU facts in runtimes/cpu.py)."""
    import inspect

    from laco_deploy.bench import llamacpp_bench, onnxrt_bench
    from laco_deploy.runtimes import llamacpp, onnxrt

    for module in (llamacpp, llamacpp_bench, onnxrt, onnxrt_bench):
        source = inspect.getsource(module)
        for needle in ("perf_counter", "VmHWM", "statistics", "/proc/cpuinfo", "subprocess"):
            assert needle not in source, (module.__name__, needle)


def test_window_nll_in_row_chunks_equals_the_whole_window_at_once():
    """A window longer than NLL_ROWS, in several chunks and a short last one: the numbers of the
    whole-window float64 log-softmax, bit for bit, and next-token cross-entropy."""
    import torch

    from laco_deploy.bench.harness import NLL_ROWS, window_nll

    rng = np.random.default_rng(0)
    n, first = 3 * NLL_ROWS + 7, 5
    logits = (rng.standard_normal((n, 300)) * 8).astype(np.float32)
    tokens = rng.integers(0, 300, n).tolist()
    rows = logits[first : n - 1].astype(np.float64)
    rows = rows - rows.max(axis=1, keepdims=True)
    whole = np.log(np.exp(rows).sum(axis=1)) - rows[np.arange(n - 1 - first), tokens[first + 1 :]]
    got = window_nll(logits, tokens, first)
    assert got.shape == (n - 1 - first,) and np.array_equal(got, whole)
    want = torch.nn.functional.cross_entropy(torch.from_numpy(logits[first : n - 1]).double(),
                                             torch.tensor(tokens[first + 1 :]), reduction="none")
    assert np.allclose(got, want.numpy())


def test_window_nll_holds_a_few_rows_in_float64_not_the_window():
    """The bench child's perplexity pass peaked 250 MiB above its speed runs when a whole 512-token
    window went to float64 (three [rows, vocab] temporaries): now NLL_ROWS rows at a time."""
    import tracemalloc

    from laco_deploy.bench.harness import NLL_ROWS, window_nll

    n, vocab = 512, 8192
    logits = np.random.default_rng(1).standard_normal((n, vocab), dtype=np.float32)  # 16 MiB
    tracemalloc.start()
    try:
        window_nll(logits, [0] * n, n // 2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    whole_window = (n // 2) * vocab * 8  # one float64 copy of the scored half: 16 MiB
    assert peak < 4 * NLL_ROWS * vocab * 8 < whole_window
