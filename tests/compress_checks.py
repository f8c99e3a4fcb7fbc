"""Checks shared by the tests of ``compress=`` (jaxmem.scan's kept values, reversible anchors)."""

import re

# The encoded dtype of a stack in XLA's text, per format (None: the f32 stack it replaces).
STACK_DTYPES = {None: "f32", "bf16": "u16", "fp8": "u8", "int8": "s8"}


def check_encoded_stack(base, small, fmt, dims: str, rows: str, saved: int) -> None:
    """``small`` (compiled with ``compress=fmt``) stacks ``[dims]`` in the format's bits where
    ``base`` (``compress=None``) stacked f32, has one f32 scale per row (``[rows]``) under fp8 and
    int8, and has at least half of ``saved`` bytes less temp."""
    text = small.as_text()
    pattern = lambda f: rf"{STACK_DTYPES[f]}\[{dims}\]"  # noqa: E731
    assert re.search(pattern(fmt), text), f"no {pattern(fmt)} stack in the compiled program"
    assert not re.search(pattern(None), text), "the f32 stack is still there"
    assert re.search(pattern(None), base.as_text())
    if fmt != "bf16":  # one f32 scale per row
        assert re.search(rf"f32\[{rows}\]", text)
    temp, base_temp = (c.memory_analysis().temp_size_in_bytes for c in (small, base))
    assert temp <= base_temp - saved // 2, (temp, base_temp, saved)
