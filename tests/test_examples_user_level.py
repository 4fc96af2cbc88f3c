"""examples/user_level.py --smoke (a subprocess, offline: scikit-learn's digits with synthetic user ids)."""

from test_examples_main import _run


def test_user_level_smoke_trains_and_reports_epsilon_over_users():
    out, acc, eps, delta, steps = _run("user_level.py", "--seed", "0")
    assert "user-level: 200 users own 1400 digits" in out and "q = 0.1 over users" in out
    assert "ledger: ['dp-sgd (user-level)'], N = 200 users" in out
    # 3 epochs of ceil(200 / 20) = 10 lots of users; σ calibrated to ε = 3 at δ = 1e-4 over users
    assert steps == 30 and delta == 1e-4 and 2.99 <= eps <= 3.0
    assert acc >= 0.5, out[-2000:]  # 0.68 with --seed 0 (chance 0.1)
