#!/usr/bin/env python3
"""Prints the coefficients of erfc_poly (src/kernels/exp_poly.hpp): a Chebyshev interpolant of
erfc(z) * exp(z^2) in t = 1 / (1 + z/2), on z in [0, 10] (t in [1/6, 1]), at N nodes, and its
worst error relative to erfc(z) in double arithmetic. Needs python3-mpmath (Debian)."""
import sys

import mpmath as mp

mp.mp.dps = 40
N = int(sys.argv[1]) if len(sys.argv) > 1 else 12
A, B = mp.mpf(1) / 6, mp.mpf(1)


def scaled_erfc(t):
    z = 2 * (1 - t) / t
    return mp.erfc(z) * mp.exp(z * z)


nodes = [(A + B) / 2 + (B - A) / 2 * mp.cos(mp.pi * (k + mp.mpf(1) / 2) / N) for k in range(N)]
values = [scaled_erfc(t) for t in nodes]
c = [2 * sum(values[k] * mp.cos(mp.pi * j * (k + mp.mpf(1) / 2) / N) for k in range(N)) / N for j in range(N)]
c[0] /= 2


def clenshaw(t):
    u = (2 * t - (A + B)) / (B - A)
    b1 = b2 = 0
    for cj in reversed(c[1:]):
        b1, b2 = 2 * u * b1 - b2 + cj, b1
    return u * b1 - b2 + c[0]


worst = max(abs(clenshaw(t) / scaled_erfc(t) - 1) for t in (1 / (1 + mp.mpf(10) * i / 4000 / 2) for i in range(4001)))
print("coefficients, c0 first:", ", ".join(mp.nstr(x, 10, min_fixed=-1, max_fixed=-1) + "f" for x in c))
print("worst relative error:", mp.nstr(worst, 3))
