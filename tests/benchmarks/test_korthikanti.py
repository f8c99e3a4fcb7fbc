"""Tests of :mod:`jaxmem.demo.korthikanti`: residual bytes per layer vs Korthikanti et al. 2022.

Activation bytes per layer with 16-bit activations, measured on the reference GPT block
(:class:`jaxmem.demo.models.Block`) stacked by a scan, against the paper's formulas.
"""

import functools

import jaxmem
import jaxmem.policies as policies
from jaxmem.demo import korthikanti

KB, KS, KH, KA = 1, 256, 64, 4  # 5 a s / h = 80: the attention core dominates without remat
SBH = KS * KB * KH


def test_korthikanti_bytes_per_layer():
    measure = functools.partial(korthikanti.block_residual_bytes, b=KB, s=KS, h=KH, a=KA)
    assert measure(policies.nothing) == 2 * SBH  # the layer input, 2sbh
    selective = measure(policies.selective())
    assert 0.75 * 34 * SBH <= selective <= 1.15 * 34 * SBH  # the paper's 34sbh
    everything = measure(policies.everything)
    assert everything >= 0.85 * SBH * (34 + 5 * KA * KS / KH)  # the paper's sbh(34 + 5as/h)
    # jaxmem.scan stacks no more than lax.scan under the same policy.
    assert measure(policies.selective(), scan=jaxmem.scan) <= selective


def test_korthikanti_table():
    table = korthikanti.korthikanti_table(KB, KS, KH, KA)
    lines = table.splitlines()
    assert lines[0].startswith("| policy | measured B/layer |") and "ratio" in lines[0]
    assert len(lines) == 6
    row = {line.split(" | ")[0].lstrip("| "): line for line in lines[2:]}
    assert row["nothing (full remat)"].endswith(f"| 2sbh | {2 * SBH:,} | 1.00 |")
    assert f"| 34sbh | {34 * SBH:,} |" in row["selective()"]
    assert (
        f"| sbh(34 + 5as/h) | {SBH * (34 + 5 * KA * KS // KH):,} |" in row["everything (no remat)"]
    )
