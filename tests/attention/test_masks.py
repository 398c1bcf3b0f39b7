"""ScoreRules' band arithmetic against brute force, and tile skipping in the flash backend."""

from __future__ import annotations

import itertools

import torch

import flashformer
from flashformer.attention import flash
from flashformer.attention.masks import ScoreRules


def allowed_matrix(rules: ScoreRules) -> torch.Tensor:
    """(Lq, Lk) bool: the band, from the definition, one entry at a time."""
    allowed = torch.zeros(rules.q_len, rules.k_len, dtype=torch.bool)
    for i, j in itertools.product(range(rules.q_len), range(rules.k_len)):
        diagonal = i + rules.k_len - rules.q_len
        ok = not (rules.causal and j > diagonal)
        if rules.window_left is not None:
            ok &= j >= diagonal - rules.window_left
        if rules.window_right is not None:
            ok &= j <= diagonal + rules.window_right
        allowed[i, j] = ok
    return allowed


def test_key_and_query_ranges_and_band_cover_match_brute_force():
    for q_len, k_len in ((13, 13), (9, 20), (20, 9), (1, 15)):
        for causal in (False, True):
            for window in (None, (3, None), (None, 2), (4, 1), (0, 0)):
                rules = ScoreRules(
                    1,
                    1,
                    q_len,
                    k_len,
                    causal=causal,
                    window_left=None if window is None else window[0],
                    window_right=None if window is None else window[1],
                )
                allowed = allowed_matrix(rules)
                keep = rules.tile_keep(0, q_len, 0, k_len, "cpu")
                band = torch.ones(q_len, k_len, dtype=torch.bool) if keep is None else keep
                assert torch.equal(band.expand(q_len, k_len), allowed)
                for q0, q1 in ((0, q_len), (2, min(5, q_len)), (q_len - 1, q_len)):
                    if q0 >= q1:
                        continue
                    lo, hi = rules.key_range(q0, q1)
                    seen = allowed[q0:q1].any(0).nonzero().flatten().tolist()
                    assert (seen[0], seen[-1] + 1) == (lo, hi) if seen else lo >= hi
                for k0, k1 in ((0, k_len), (3, 7), (k_len - 1, k_len)):
                    lo, hi = rules.query_range(k0, k1)
                    seen = allowed[:, k0:k1].any(1).nonzero().flatten().tolist()
                    assert (seen[0], seen[-1] + 1) == (lo, hi) if seen else lo >= hi
                    for q0, q1 in ((0, q_len), (0, min(4, q_len))):
                        covered = bool(allowed[q0:q1, k0:k1].all())
                        assert rules.band_covers(q0, q1, k0, k1) == covered


def test_flash_visits_only_tiles_inside_the_band(monkeypatch):
    """The bias function is called once per visited tile: count the calls."""
    monkeypatch.setattr(flash, "BLOCK_Q", 32)
    monkeypatch.setattr(flash, "BLOCK_K", 32)
    calls = []

    def bias(q_pos, k_pos):
        calls.append((int(q_pos[0]), int(k_pos[0])))
        return torch.zeros(len(q_pos), len(k_pos))

    q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))
    for kwargs, expected_tiles in (
        ({}, 16),  # 4 x 4 tiles
        ({"causal": True}, 10),  # 1 + 2 + 3 + 4: the upper triangle is never touched
        ({"causal": True, "window": (31, None)}, 7),  # the diagonal tile and the one before it
    ):
        calls.clear()
        with torch.no_grad():
            flashformer.attention(q, k, v, bias=bias, backend="flash", **kwargs)
        assert len(calls) == expected_tiles, (kwargs, calls)
