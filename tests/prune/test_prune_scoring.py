"""Scoring rules and masks against the published formulas, on matrices small enough to check by hand."""

from __future__ import annotations

import math

import pytest
import torch

from laco_deploy.prune import scoring
from laco_deploy.prune.owl import outlier_share, owl_ratios
from laco_deploy.prune.stats import InputStats


def test_magnitude_is_absolute_value():
    w = torch.tensor([[1.0, -3.0, 0.5], [-0.25, 2.0, -2.5]])
    assert torch.equal(scoring.magnitude_scores(w), torch.tensor([[1.0, 3.0, 0.5], [0.25, 2.0, 2.5]]))


def test_wanda_score_by_hand():
    # X: 2 tokens x 2 features -> ||X_0|| = sqrt(1 + 9) , ||X_1|| = sqrt(4 + 0) = 2
    x = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    w = torch.tensor([[1.0, -2.0], [3.0, 0.5]])
    sq = x.pow(2).sum(0)
    expected = torch.tensor([[1.0 * math.sqrt(10), 2.0 * 2], [3.0 * math.sqrt(10), 0.5 * 2]])
    assert torch.allclose(scoring.wanda_scores(w, sq), expected)


def test_wanda_compares_within_each_output_row():
    # Row 0 has large weights, row 1 small ones: a per-matrix threshold would prune row 1 entirely,
    # Wanda prunes half of each row.
    w = torch.tensor([[4.0, 5.0, 6.0, 7.0], [0.1, 0.4, 0.2, 0.3]])
    sq = torch.ones(4)
    mask = scoring.row_mask(scoring.wanda_scores(w, sq), 0.5)
    assert mask.tolist() == [[True, True, False, False], [True, False, True, False]]


def test_wanda_activation_norm_changes_the_choice():
    w = torch.tensor([[1.0, 2.0]])
    assert scoring.row_mask(scoring.magnitude_scores(w), 0.5).tolist() == [[True, False]]
    # feature 0 is 3x as strong: 1 * 3 > 2 * 1, so Wanda keeps column 0
    assert scoring.row_mask(scoring.wanda_scores(w, torch.tensor([9.0, 1.0])), 0.5).tolist() == [[False, True]]


@pytest.mark.parametrize("ratio,cols", [(0.5, 16), (0.3, 10), (0.7, 9), (0.0, 8)])
def test_row_mask_every_row_at_the_ratio(ratio, cols):
    torch.manual_seed(0)
    scores = torch.randn(12, cols).abs()
    mask = scoring.row_mask(scores, ratio)
    k = scoring.prune_count(cols, ratio)
    assert k == int(cols * ratio + 0.5)
    assert (mask.sum(1) == k).all()
    # pruned entries are the k lowest of their row
    for r in range(12):
        if k:
            assert scores[r][mask[r]].max() <= scores[r][~mask[r]].min()


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (1, 4)])
def test_nm_mask_keeps_the_n_largest_of_every_group(n, m):
    torch.manual_seed(1)
    scores = torch.randn(6, 32).abs()
    mask = scoring.nm_mask(scores, n, m)
    groups_mask = mask.view(6, -1, m)
    assert (groups_mask.sum(2) == m - n).all()
    groups = scores.view(6, -1, m)
    kept_min = torch.where(groups_mask, torch.inf, groups).amin(2)
    pruned_max = torch.where(groups_mask, groups, -torch.inf).amax(2)
    assert (pruned_max <= kept_min).all()


def test_nm_mask_short_last_group_keeps_at_most_n():
    scores = torch.tensor([[1.0, 2.0, 3.0, 4.0, 9.0, 8.0, 7.0]])  # groups [1 2 3 4] [9 8 7]
    mask = scoring.nm_mask(scores, 2, 4)
    assert mask.tolist() == [[True, True, False, False, False, False, True]]
    with pytest.raises(ValueError):
        scoring.nm_mask(scores, 4, 4)


def test_hessian_is_two_xtx_over_tokens():
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.0, 1.0]])
    s = InputStats(tokens=3, sq_sum=x.pow(2).sum(0), lin_sum=x.sum(0), xtx=x.T @ x)
    assert torch.allclose(s.hessian(), 2 * x.T @ x / 3)
    assert torch.allclose(s.variance(), x.var(0, unbiased=False))


# ---------------------------------------------------------------- SparseGPT


def _naive_obs(w: torch.Tensor, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """OBS, column by column, with the explicit inverse Hessian and Gaussian elimination of each
    visited column: w_r -= (w_rj / [H^-1]_jj) [H^-1]_j,: for pruned w_rj (the paper's eq. 3)."""
    w = w.clone().double()
    hinv = torch.linalg.inv(h.double())
    for j in range(w.shape[1]):
        d = hinv[j, j]
        for r in range(w.shape[0]):
            if mask[r, j]:
                w[r] -= (w[r, j] / d) * hinv[j]
        hinv = hinv - torch.outer(hinv[:, j], hinv[j]) / d
    return w


def _problem(rows=6, cols=8, tokens=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cols, generator=g) * torch.linspace(0.5, 2.0, cols)
    w = torch.randn(rows, cols, generator=g)
    return w, 2 * x.T @ x / tokens, x


def _damped(h: torch.Tensor, damp: float) -> torch.Tensor:
    return h + damp * torch.mean(torch.diag(h)) * torch.eye(h.shape[0])


def test_sparsegpt_equals_naive_obs_for_the_same_mask():
    w, h, _ = _problem()
    new, mask = scoring.sparsegpt_prune(w, h, ratio=0.5, blocksize=128, damp=0.01)
    # mask rule of the paper: lowest w^2 / [chol(H^-1)]_jj^2 in each row (one block holds all columns)
    u = torch.linalg.cholesky(torch.linalg.inv(_damped(h, 0.01).double()), upper=True)
    err = w.double().pow(2) / torch.diag(u).pow(2)
    assert torch.equal(mask, scoring.row_mask(err, 0.5))
    expected = _naive_obs(w, _damped(h, 0.01), mask)
    assert torch.allclose(new.double(), expected, atol=1e-4)
    assert (new[mask] == 0).all() and (new[~mask] != 0).all()


@pytest.mark.parametrize("blocksize", [3, 4, 128])
def test_sparsegpt_blocks_give_exact_row_ratio_and_fixed_mask_matches_naive(blocksize):
    w, h, _ = _problem(cols=10, seed=2)
    new, mask = scoring.sparsegpt_prune(w, h, ratio=0.5, blocksize=blocksize, damp=0.01)
    assert (mask.sum(1) == 5).all()
    assert torch.allclose(new.double(), _naive_obs(w, _damped(h, 0.01), mask), atol=1e-4)


def test_sparsegpt_nm_groups_valid():
    w, h, _ = _problem(rows=5, cols=16, seed=3)
    new, mask = scoring.sparsegpt_prune(w, h, n=2, m=4, blocksize=6, damp=0.01)
    assert (mask.view(5, -1, 4).sum(2) == 2).all()
    assert ((new != 0).view(5, -1, 4).sum(2) <= 2).all()
    assert torch.allclose(new.double(), _naive_obs(w, _damped(h, 0.01), mask), atol=1e-4)


def test_sparsegpt_reconstructs_better_than_masking_alone():
    # correlated inputs (rank 8 + noise): the OBS update can move pruned weights onto their neighbours
    g = torch.Generator().manual_seed(4)
    x = torch.randn(200, 8, generator=g) @ torch.randn(8, 32, generator=g) + 0.1 * torch.randn(200, 32, generator=g)
    w = torch.randn(16, 32, generator=g)
    h = 2 * x.T @ x / 200
    new, mask = scoring.sparsegpt_prune(w, h, ratio=0.5, blocksize=8, damp=0.01)
    err_obs = ((new - w) @ x.T).pow(2).sum()
    masked = w.masked_fill(mask, 0.0)
    err_mask = ((masked - w) @ x.T).pow(2).sum()
    wanda = w.masked_fill(scoring.row_mask(scoring.wanda_scores(w, x.pow(2).sum(0)), 0.5), 0.0)
    err_wanda = ((wanda - w) @ x.T).pow(2).sum()
    assert err_obs < 0.8 * err_mask and err_obs < err_wanda


def test_sparsegpt_dead_inputs_are_zeroed():
    w, h, _ = _problem(cols=6, seed=5)
    h[2, :] = 0
    h[:, 2] = 0
    new, _mask = scoring.sparsegpt_prune(w, h, ratio=0.5, damp=0.01)
    assert (new[:, 2] == 0).all()


# ---------------------------------------------------------------- structured importance, OWL


def test_structured_importances_by_hand():
    w = torch.tensor([[1.0, -2.0, 0.0], [3.0, 1.0, -1.0]])
    sq = torch.tensor([4.0, 1.0, 9.0])  # norms 2, 1, 3
    assert torch.allclose(scoring.wanda_row_importance(w, sq), torch.tensor([2.0 + 2.0 + 0.0, 6.0 + 1.0 + 3.0]))
    assert torch.allclose(scoring.wanda_column_importance(w, sq), torch.tensor([8.0, 3.0, 3.0]))
    var = torch.tensor([0.5, 2.0, 1.0])
    assert torch.allclose(scoring.fluctuation_importance(w, var), torch.tensor([0.5 * 10, 2.0 * 5, 1.0 * 1]))
    assert scoring.group_sum(torch.arange(6.0), 2).tolist() == [3.0, 12.0]
    assert scoring.keep_indices(torch.tensor([5.0, 1.0, 3.0, 0.5]), 2).tolist() == [0, 2]


def test_owl_ratios_average_to_target_and_favour_outlier_layers():
    ratios = owl_ratios([0.01, 0.05, 0.03, 0.02], target=0.5, lam=0.08)
    assert sum(ratios) / 4 == pytest.approx(0.5)
    assert max(ratios) - min(ratios) == pytest.approx(0.16)
    assert ratios[1] == min(ratios) and ratios[0] == max(ratios)  # most outliers -> least pruned
    assert owl_ratios([0.2, 0.2], 0.5, 0.08) == [0.5, 0.5]


def test_outlier_share_by_hand():
    scores = [torch.tensor([[1.0, 1.0, 1.0, 13.0]]), torch.tensor([1.0, 1.0, 1.0, 1.0])]
    # mean = 20 / 8 = 2.5; with m = 5 only 13 > 12.5 -> 1 of 8
    assert outlier_share(scores, 5.0) == pytest.approx(1 / 8)
