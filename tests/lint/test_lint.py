"""jaxmem.lint and jaxmem.LintWarning: four seeded programs whose setting does nothing (first
shown so by the compiled program, then found, at the line that gave it), five clean programs
with no finding, and the warnings the loops give while traced."""

from __future__ import annotations

import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import jaxmem
from benchmarks.optimize import QUICK, make_args
from benchmarks.optimize import make_loss as make_transformer_loss

L, B, D = 6, 4, 32
THIS = Path(__file__).resolve()


def _line(marker: str) -> int:
    """The line of this file marked ``# marker`` (one only)."""
    text = THIS.read_text().splitlines()
    lines = [i for i, line in enumerate(text, 1) if line.endswith(f"# {marker}")]
    assert len(lines) == 1, lines
    return lines[0]


def _where(marker: str, function: str) -> str:
    return f"{THIS}:{_line(marker)} ({function})"


def _memory(fn, *args, grad=True):
    """The compiled program's ``memory_analysis()`` (of its gradient with ``grad``), the
    seeded settings' warnings aside (tested on their own below)."""
    program = jax.grad(fn, argnums=tuple(range(len(args)))) if grad else fn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxmem.LintWarning)
        return jax.jit(program).lower(*args).compile().memory_analysis()


def _lint_warnings(fn, *args, grad=True):
    """The LintWarnings tracing ``fn`` (its gradient with ``grad``) gives, each recorded."""
    program = jax.grad(fn, argnums=tuple(range(len(args)))) if grad else fn
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.eval_shape(program, *args)
    return [w for w in caught if issubclass(w.category, jaxmem.LintWarning)]


def _args():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(k1, (D, D)) * D**-0.5
    xs = jax.random.normal(k2, (L, B, D))
    h0 = jax.random.normal(k3, (B, D))
    return w, xs, h0


def _weights():
    return jax.random.normal(jax.random.key(1), (L, D, D)) * D**-0.5


# --- the seeded programs: one per kind -----------------------------------------------------------


def named_policy_loss(policy):
    """A step that names its pre-activation mlp_in; ``policy`` of jaxmem.scan over it."""

    def loss(w, xs, h0):
        def step(h, x):
            a = jaxmem.name(h @ w + x, "mlp_in")
            return jnp.tanh(a), None

        h, _ = jaxmem.scan(step, h0, xs, policy=policy)  # SITE:name_unmatched
        return jnp.sum(h**2)

    return loss


def carry_offload_loss(offload):
    """A step that names its carry and offloads that name: a carry is not a residual."""

    def loss(w, xs, h0):
        def step(h, x):
            h = jaxmem.name(h, "decoder_layer_input")
            return jnp.tanh(h @ w + x), None

        h, _ = jaxmem.scan(step, h0, xs, offload=offload)  # SITE:offload_noop
        return jnp.sum(h**2)

    return loss


def cast_weights_forward(return_weights: bool):
    """A layer stack whose step returns its weights, cast to bf16, as ys (or None)."""

    def forward(ws, h0):
        def step(h, w):
            h = jnp.tanh(h @ w)
            return h, w.astype(jnp.bfloat16) if return_weights else None

        return jaxmem.scan(step, h0, ws)  # SITE:stacked_params

    return forward


def weights_as_ys_loss(return_weights: bool):
    """MaxText #4964's shape: a layer stack whose step returns its weights (cast to bf16) as ys,
    which the loss reads: the gradient holds a second stack of the weights in its temp."""

    def loss(ws, h0):
        def step(h, w):
            return jnp.tanh(h @ w), w.astype(jnp.bfloat16) if return_weights else None

        h, wys = jaxmem.scan(step, h0, ws)  # SITE:stacked_params_loss
        extra = jnp.mean(wys.astype(jnp.float32) ** 2) if return_weights else 0.0
        return jnp.sum(h**2) + extra

    return loss


def rnn_loss(compress):
    """An RNN whose loss reads every ys: its gradient keeps nothing but those ys."""

    def loss(w, xs, h0):
        step = lambda h, x: (jnp.tanh(h @ w + x),) * 2
        _, ys = jaxmem.scan(step, h0, xs, compress=compress)  # SITE:option_noop
        return jnp.sum(ys**2)

    return loss


def test_name_unmatched_a_policy_saving_a_name_the_step_lacks():
    args = _args()
    unmatched = named_policy_loss(jaxmem.policies.save("mlp_out"))
    # The step names mlp_in only: save("mlp_out") saves what "nothing" saves, byte for byte.
    assert (
        _memory(unmatched, *args).temp_size_in_bytes
        == _memory(named_policy_loss("nothing"), *args).temp_size_in_bytes
    )
    assert _memory(unmatched, *args).temp_size_in_bytes != (
        _memory(named_policy_loss(jaxmem.policies.save("mlp_in")), *args).temp_size_in_bytes
    )
    found = jaxmem.lint(unmatched, *args)
    assert [(f.kind, f.subject) for f in found] == [("name_unmatched", "name 'mlp_out'")]
    assert found[0].where == _where("SITE:name_unmatched", "loss")
    assert "mlp_in" in found[0].message  # the names the step has
    matched = jaxmem.lint(named_policy_loss(jaxmem.policies.save("mlp_in")), *args)
    assert "name_unmatched" not in [f.kind for f in matched]


def test_offload_noop_offloading_a_carry():
    args = _args()
    with_offload = carry_offload_loss(("decoder_layer_input",))
    assert (
        _memory(with_offload, *args).temp_size_in_bytes
        == _memory(carry_offload_loss(None), *args).temp_size_in_bytes
    )
    found = jaxmem.lint(with_offload, *args)
    assert [(f.kind, f.subject) for f in found] == [
        ("offload_noop", "offload=('decoder_layer_input',)")
    ]
    assert found[0].where == _where("SITE:offload_noop", "loss")
    assert "not a residual" in found[0].message


def test_stacked_params_a_step_returning_its_weights():
    ws, (_, _, h0) = _weights(), _args()
    with_ys = _memory(cast_weights_forward(True), ws, h0, grad=False)
    without = _memory(cast_weights_forward(False), ws, h0, grad=False)
    # The program holds a second, bf16, stack of the weights (and one more output's entry).
    extra = with_ys.output_size_in_bytes - without.output_size_in_bytes
    assert L * D * D * 2 <= extra <= L * D * D * 2 + 64
    found = jaxmem.lint(cast_weights_forward(True), ws, h0)
    assert [(f.kind, f.subject) for f in found] == [("stacked_params", "ys")]
    assert found[0].where == _where("SITE:stacked_params", "forward")
    assert jaxmem.lint(cast_weights_forward(False), ws, h0) == ()


def test_stacked_params_held_in_the_gradients_temp():
    ws, (_, _, h0) = _weights(), _args()
    with_ys = _memory(weights_as_ys_loss(True), ws, h0)
    without = _memory(weights_as_ys_loss(False), ws, h0)
    # The gradient's temp holds the bf16 stack of the weights (and what the loss computes of it).
    assert with_ys.temp_size_in_bytes - without.temp_size_in_bytes >= L * D * D * 2
    found = jaxmem.lint(weights_as_ys_loss(True), ws, h0)
    assert [(f.kind, f.subject) for f in found] == [("stacked_params", "ys")]
    assert found[0].where == _where("SITE:stacked_params_loss", "loss")
    assert found[0].message.startswith("ys of this jaxmem.scan step is the step's xs slice")
    assert jaxmem.lint(weights_as_ys_loss(False), ws, h0) == ()


def test_option_noop_compress_with_nothing_to_encode():
    args = _args()
    compressed, plain = _memory(rnn_loss("int8"), *args), _memory(rnn_loss(None), *args)
    assert compressed.temp_size_in_bytes == plain.temp_size_in_bytes
    found = jaxmem.lint(rnn_loss("int8"), *args)
    assert [(f.kind, f.subject) for f in found] == [("option_noop", "compress='int8'")]
    assert found[0].where == _where("SITE:option_noop", "loss")


def test_option_noop_found_by_compiling_a_policy_that_saves_everything():
    # Not decidable while tracing (no warning): the compiled gradient is the same with it.
    args = _args()
    loss = named_policy_loss(jax.checkpoint_policies.everything_saveable)
    assert (
        _memory(loss, *args).temp_size_in_bytes
        == _memory(named_policy_loss(None), *args).temp_size_in_bytes
    )
    assert _lint_warnings(loss, *args) == []
    found = jaxmem.lint(loss, *args)
    assert [(f.kind, f.subject) for f in found] == [("option_noop", "policy=everything_saveable")]
    assert found[0].where == _where("SITE:name_unmatched", "loss")


def test_option_noop_checkpoints_as_long_as_the_loop():
    args = _args()

    def loss(w, xs, h0, checkpoints=L):
        step = lambda h, x: (jnp.tanh(h @ w + x),) * 2
        _, ys = jaxmem.scan(step, h0, xs, checkpoints=checkpoints)  # SITE:checkpoints
        return jnp.sum(ys**2)

    plain = lambda w, xs, h0: loss(w, xs, h0, checkpoints=None)
    assert _memory(loss, *args).temp_size_in_bytes >= _memory(plain, *args).temp_size_in_bytes
    found = jaxmem.lint(loss, *args)
    assert [(f.kind, f.subject) for f in found] == [("option_noop", f"checkpoints={L}")]
    assert found[0].where == _where("SITE:checkpoints", "loss")
    assert len(_lint_warnings(loss, *args)) == 1


def test_name_unmatched_in_a_jax_checkpoint_and_lax_scan():
    # jax.checkpoint is not jaxmem's: lint finds it, nothing warns. JAX records no user line
    # for a checkpoint in a loop's step: the finding names the loop's.
    ws, (_, _, h0) = _weights(), _args()
    policy = jax.checkpoint_policies.save_only_these_names("mlp_in", "mlp_out")

    def loss(ws, h0):
        def block(h, w):
            return jnp.tanh(checkpoint_name(h @ w, "mlp_in")), None

        step = jax.checkpoint(block, policy=policy)
        h, _ = jax.lax.scan(step, h0, ws)  # SITE:jax_checkpoint
        return jnp.sum(h**2)

    found = jaxmem.lint(loss, ws, h0)
    assert [(f.kind, f.subject) for f in found] == [("name_unmatched", "name 'mlp_out'")]
    assert found[0].where == _where("SITE:jax_checkpoint", "loss")
    assert _lint_warnings(loss, ws, h0) == []


def test_stacked_params_of_lax_scan_only_where_the_ys_are_used():
    ws, (_, _, h0) = _weights(), _args()

    def forward(ws, h0, use):
        first = ws[0]

        def step(h, w):
            return jnp.tanh(h @ w), first  # a closed-over value, the same in every step

        h, ys = jax.lax.scan(step, h0, ws)  # SITE:lax_scan
        return (h, ys) if use else h

    found = jaxmem.lint(lambda ws, h0: forward(ws, h0, True), ws, h0)
    assert [(f.kind, f.subject) for f in found] == [("stacked_params", "ys")]
    assert found[0].where == _where("SITE:lax_scan", "forward")
    assert jaxmem.lint(lambda ws, h0: forward(ws, h0, False), ws, h0) == ()


# --- the clean programs: no finding, no warning -------------------------------------------------


def _transformer():
    return make_transformer_loss(QUICK, jax.lax.scan), make_args(QUICK)


def _rnn():
    def loss(w, xs, h0):
        step = lambda h, x: (jnp.tanh(h @ w + x),) * 2
        _, ys = jaxmem.scan(step, h0, xs)
        return jnp.sum(ys**2)

    return loss, _args()


def _nnx_stack():
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(D, D, rngs=rngs)

        def __call__(self, x):
            return jnp.tanh(self.linear(x))

    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return Block(nnx.Rngs(key))

    graphdef, state = nnx.split(make(jax.random.split(jax.random.key(2), L)))

    def loss(state, x):
        stack = nnx.merge(graphdef, state)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(h, block):
            return block(h)

        return jnp.sum(run(x, stack) ** 2)

    return loss, (state, _args()[2])


def _equinox_stack():
    eqx = pytest.importorskip("equinox")
    layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(D, D, key=k))(
        jax.random.split(jax.random.key(3), L)
    )
    params, static = eqx.partition(layers, eqx.is_array)

    def loss(params, x):
        def step(h, p):
            layer = eqx.combine(p, static)
            return jnp.tanh(jax.vmap(layer)(h)), None

        h, _ = jax.lax.scan(step, x, params)
        return jnp.sum(h**2)

    return loss, (params, _args()[2])


def _checkpointed_stack():
    policy = jax.checkpoint_policies.save_only_these_names("mlp_in", "mlp_out")

    def loss(ws, h0):
        def block(h, w):
            a = checkpoint_name(h @ w, "mlp_in")
            return checkpoint_name(jnp.tanh(a) @ w, "mlp_out"), None

        h, _ = jax.lax.scan(jax.checkpoint(block, policy=policy), h0, ws)
        return jnp.sum(h**2)

    return loss, (_weights(), _args()[2])


CLEAN = {
    "transformer": _transformer,
    "rnn": _rnn,
    "nnx_stack": _nnx_stack,
    "equinox_stack": _equinox_stack,
    "checkpointed_stack": _checkpointed_stack,
}


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_a_clean_program_has_no_finding_and_no_warning(name):
    loss, args = CLEAN[name]()
    assert jaxmem.lint(loss, *args) == ()
    assert jaxmem.lint(jaxmem.optimize(loss), *args) == ()
    assert _lint_warnings(jaxmem.optimize(loss), *args) == []


# --- the warnings -----------------------------------------------------------------------------

SEEDED = {
    "name_unmatched": (
        lambda: named_policy_loss(jaxmem.policies.save("mlp_out")),
        _args,
        True,
        "loss",
    ),
    "offload_noop": (lambda: carry_offload_loss(("decoder_layer_input",)), _args, True, "loss"),
    "stacked_params": (
        lambda: cast_weights_forward(True),
        lambda: (_weights(), _args()[2]),
        False,
        "forward",
    ),
    "option_noop": (lambda: rnn_loss("int8"), _args, True, "loss"),
}


@pytest.mark.parametrize("kind", sorted(SEEDED))
def test_a_seeded_program_warns_once_at_the_users_line(kind):
    make, args, grad, _ = SEEDED[kind]
    caught = _lint_warnings(make(), *args(), grad=grad)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert (Path(caught[0].filename).resolve(), caught[0].lineno) == (THIS, _line(f"SITE:{kind}"))
    assert str(caught[0].message).startswith(f"{kind}: ")
    assert caught[0].category is jaxmem.LintWarning


@pytest.mark.parametrize("kind", sorted(SEEDED))
def test_the_switch_silences_the_warnings(kind):
    make, args, grad, _ = SEEDED[kind]
    program = jax.grad(make(), argnums=(0, 1)) if grad else make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", jaxmem.LintWarning)
        jax.eval_shape(program, *args())
    assert caught == []


def test_the_warnings_are_errors_where_jaxmem_warnings_are():
    # pyproject's "error:::jaxmem" (a filter by module) catches them: their module is jaxmem's.
    with warnings.catch_warnings():
        warnings.filterwarnings("error", module="jaxmem")
        with pytest.raises(jaxmem.LintWarning, match="option_noop"):
            jax.eval_shape(jax.grad(rnn_loss("int8")), *_args())


def test_lint_never_warns_and_checks_a_non_scalar_program_by_tracing_only():
    args = _args()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [f.kind for f in jaxmem.lint(rnn_loss("int8"), *args)] == ["option_noop"]
        # Its gradient is not taken: compress is not judged; the traced names are.
        both = lambda w, xs, h0: (
            rnn_loss("int8")(w, xs, h0),
            named_policy_loss(jaxmem.policies.save("mlp_out"))(w, xs, h0),
        )
        assert [f.kind for f in jaxmem.lint(both, *args)] == ["name_unmatched"]


def test_an_option_of_optimize_warns_at_the_users_loop():
    # optimize runs the user's lax.scan as jaxmem.scan with its options: the loop's line is named.
    args = _args()

    def loss(w, xs, h0):
        step = lambda h, x: (jnp.tanh(h @ w + x),) * 2
        _, ys = jax.lax.scan(step, h0, xs)  # SITE:optimize
        return jnp.sum(ys**2)

    caught = _lint_warnings(jaxmem.optimize(loss, compress="int8"), *args)
    assert [(Path(w.filename).resolve(), w.lineno) for w in caught] == [
        (THIS, _line("SITE:optimize"))
    ]
    found = jaxmem.lint(jaxmem.optimize(loss, compress="int8"), *args)
    assert [(f.kind, f.subject, f.where) for f in found] == [
        ("option_noop", "compress='int8'", _where("SITE:optimize", "loss"))
    ]


def test_bad_input_is_a_clear_error():
    with pytest.raises(TypeError, match=r"jaxmem.lint: fn must be callable"):
        jaxmem.lint(None, jnp.ones(3))
    with pytest.raises(TypeError, match=r"jaxmem.lint: .*args\[1\]\['w'\]"):
        jaxmem.lint(lambda x, p: x, jnp.ones(3), {"w": "not an array"})
    with pytest.raises(TypeError, match=r"jaxmem.lint: .*kwargs\['scale'\]"):
        jaxmem.lint(lambda x, scale: x * scale, jnp.ones(3), scale=object())


def test_a_finding_is_frozen_and_prints_its_line():
    f = jaxmem.Finding(
        "option_noop", "compress='int8' saves nothing", "a.py:3 (f)", "compress='int8'"
    )
    assert str(f) == "a.py:3 (f): option_noop: compress='int8' saves nothing"
    # What lint finds reads as a sentence, its subject first.
    (found,) = jaxmem.lint(rnn_loss("int8"), *_args())
    assert found.message.startswith("compress='int8' ") and str(found).endswith(found.message)
    with pytest.raises(AttributeError):
        f.kind = "x"
