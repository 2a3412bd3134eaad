"""Issue 16's SQNR targets for fine-grained fp8 scaling, as small tests of the bench's figures.

The data, the body and the SQNR are ``bench/bench_granularity.py``'s own (its functions,
imported from ``bench/``, on the suite's path), on the issue's shape: a 256 x
1024 Gaussian with 4 random rows or columns times 1e5, E4M3, the pure-torch twins. Each
quantize takes milliseconds. The targets (issue 16, item 7; docs/benchmarks.md):

- 4 rows x1e5: every fine granularity (``row``, ``1x128``, ``mx``, with each of their step
  options) keeps the body at >= 25 dB, while per tensor collapses below 10 dB (the bench
  measured 4.4 to 7.5 dB over seeds 0-7, against 31.5 dB without the outliers);
- 4 columns x1e5: ``1x128`` >= 20 dB and ``mx`` >= 23 dB (both roundings).

The column targets depend on the shape by construction: 4 outlier columns spoil the 1x128
and 1x32 blocks they fall in, a larger share of them when K is smaller (at K = 512, 1x128
gave 18-19 dB), so K stays the issue's 1024. ``mx`` (rceil) clears its 23 dB by only 0.1 to
0.4 dB (seeds 0-7), so three seeds are tested, not one. ``1x128`` with ``power_of_two=True``
is not held to 20 dB: rounded up, the step of a block an outlier shares is up to twice as
coarse (18.6 dB at seed 0); the block policy's default has no powers of two.
"""

from __future__ import annotations

import math
from typing import Any

import bench_granularity as bench
import pytest
import torch

from computectx.dtypes import Fp8Format
from computectx.formats import Backend

ROWS, COLS = 256, 1024
SEEDS = (0, 1, 2)
E4M3 = Fp8Format.parse("e4m3")


def body_sqnr(kind: str, factor: float, seed: int, **options: Any) -> float:
    x, body = bench.outlier_data(kind, factor, ROWS, COLS, seed)
    db: float = bench.body_sqnr(x, body, E4M3, Backend.REFERENCE, options)
    return db


FINE_OPTIONS: list[dict[str, Any]] = [
    {"granularity": "row"},
    {"granularity": "row", "power_of_two": False},
    {"granularity": "1x128"},
    {"granularity": "1x128", "power_of_two": True},
    {"granularity": "mx"},
    {"granularity": "mx", "mx_rounding": "floor"},
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("options", FINE_OPTIONS, ids=lambda o: "-".join(map(str, o.values())))
def test_fine_granularities_keep_the_body_under_1e5_row_outliers(
    options: dict[str, Any], seed: int
) -> None:
    assert body_sqnr("rows", 1e5, seed, **options) >= 25.0


@pytest.mark.parametrize("seed", SEEDS)
def test_per_tensor_collapses_under_1e5_row_outliers(seed: int) -> None:
    assert body_sqnr("rows", 1e5, seed, granularity="tensor") < 10.0
    assert body_sqnr("none", 1.0, seed, granularity="tensor") > 30.0  # the same data, no outliers


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("options", "target"),
    [
        ({"granularity": "1x128"}, 20.0),
        ({"granularity": "mx"}, 23.0),
        ({"granularity": "mx", "mx_rounding": "floor"}, 23.0),
    ],
    ids=["1x128", "mx-rceil", "mx-floor"],
)
def test_column_outliers_at_1e5(options: dict[str, Any], target: float, seed: int) -> None:
    assert body_sqnr("cols", 1e5, seed, **options) >= target


def test_the_sqnr_is_the_documented_formula() -> None:
    # 10 log10(sum x^2 / sum (x_hat - x)^2) over the mask: 25 / 0.25, 20 dB.
    exact = torch.tensor([3.0, 4.0, 100.0])
    approx = torch.tensor([3.0, 4.5, 0.0])
    mask = torch.tensor([True, True, False])
    assert bench.sqnr(approx, exact, mask) == pytest.approx(20.0)
    assert bench.sqnr(exact, exact) == math.inf


# The same targets carried to the fp8 linear (ours, docs/benchmarks.md): the bench's linear on
# its own data (X 256 x 1024 bf16, W 256 x 1024 float32, dY 256 x 256 bf16, the outliers in X
# and dY), SQNR over the results' bodies. At 1e5 outlier tokens the output's and dX's other
# rows, and at 1e5 outlier channels and features dW's other elements, keep >= 25 dB under
# every fine granularity (measured 28.4 to 28.8; gw_hp's float32 dW far above) and fall
# below 10 dB under per-tensor scaling (6.7, 7.2 and 2.9).
LINEAR_FLAGS = ["fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_block", "fp8_mx"]


def linear_sqnr(flag: str, kind: str) -> tuple[float, float, float]:
    data = bench.linear_data(kind, 1e5, ROWS, COLS, 256, 0, "cpu")
    got = bench.linear_sqnr(flag, data, "cpu")
    assert not isinstance(got, str), got
    y, dx, dw = (float(v) for v in got)
    return y, dx, dw


@pytest.mark.parametrize("flag", LINEAR_FLAGS)
def test_the_fine_linears_keep_the_body_under_1e5_outliers(flag: str) -> None:
    y, dx, _ = linear_sqnr(flag, "rows")
    assert y >= 25.0 and dx >= 25.0, (y, dx)
    assert linear_sqnr(flag, "cols")[2] >= 25.0


def test_the_per_tensor_linear_collapses_under_1e5_outliers() -> None:
    y, dx, _ = linear_sqnr("fp8_e4m3_dynamic", "rows")
    assert y < 10.0 and dx < 10.0, (y, dx)
    assert linear_sqnr("fp8_e4m3_dynamic", "cols")[2] < 10.0
