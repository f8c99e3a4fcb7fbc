"""Tests of :mod:`jaxmem.policies`: semantics read structurally from the saved residuals.

The reference GPT block (:class:`jaxmem.demo.models.Block`, tagged with the name vocabulary) is
stacked ``L`` times with ``jax.lax.scan(jax.checkpoint(step, policy=p))`` and with
``jaxmem.scan(step, ..., policy=p)``, and each policy is judged by the residuals the gradient
stacks per layer: their shapes, their memory space (an offloaded residual has a ``<host>`` aval,
the output of a ``device_put`` to host inside the scan body) and, for ``lax.scan``, the checkpoint
name of the value each residual is (traced back through the scan body). ``jaxmem.scan`` may stack
an equivalent tensor (e.g. the matmul before a bias add, or before a transpose) instead of the
named one, so there the residuals are identified by shape: the sizes below make each named
tensor's shape unique among the block's activations where it matters.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
import jaxmem.policies as policies
from jaxmem._src import checks
from jaxmem._src import jax_compat as _jc
from jaxmem._src.listing import saved_residuals
from jaxmem._src.remat import policies as policies_src
from jaxmem._src.remat.names import NAMES, name
from jaxmem.demo import models

# Offloading policies checked on CPU, where offload is the identity: each loop under one warns
# offload_noop, as a user's would.
pytestmark = pytest.mark.filterwarnings("ignore:offload_noop. offload of:jaxmem.LintWarning")

B, S, D, A, F, L = 2, 8, 12, 3, 20, 3  # batch, seq, width, heads, MLP width, layers
K = D // A
CARRY = (B, S, D)  # decoder_layer_input, out_proj, mlp_out
QKV = (B, S, 3, A, K)
ATTN_OUT = (B, S, A, K)
MLP = (B, S, F)  # mlp_in, mlp_act
CORE = (B, A, S, S)  # attention_scores, attention_probs
FAST_COMPILE = {"xla_backend_optimization_level": 0}  # tiny programs: compile time dominates


# ------------------------------------------------------------------------------------------
# The block stack and the structural residual listing.


BLOCK = models.Block(num_heads=A, d_ff=F)


def _step(h, p):
    return BLOCK.apply({"params": p}, h), None


def _lax_scan(step, h, ps, policy):
    if policy is not None:
        step = jax.checkpoint(step, policy=policy, prevent_cse=False)
    return jax.lax.scan(step, h, ps)


def _jaxmem_scan(step, h, ps, policy):
    return jaxmem.scan(step, h, ps, policy=policy)


SCANS = {"lax.scan": _lax_scan, "jaxmem.scan": _jaxmem_scan}


def make_loss(scan, policy):
    def loss(h, ps):
        out, _ = scan(_step, h, ps, policy)
        return jnp.sum(jnp.tanh(out))

    return loss


@functools.cache
def abstract_args(dtype=jnp.float32):
    h = jax.ShapeDtypeStruct(CARRY, dtype)
    one = jax.eval_shape(BLOCK.init, jax.random.key(0), h)["params"]
    ps = jax.tree.map(lambda p: jax.ShapeDtypeStruct((L, *p.shape), dtype), one)
    return h, ps


@functools.cache
def concrete_args():
    rng = np.random.default_rng(0)  # numpy: no compilation for test data
    h, ps = abstract_args()
    return jax.tree.map(lambda a: jnp.asarray(0.3 * rng.standard_normal(a.shape), a.dtype), (h, ps))


@dataclasses.dataclass(frozen=True)
class Stacked:
    """One loop-stacked residual: per-layer shape, dtype, memory and what it is."""

    shape: tuple[int, ...]
    dtype: str
    host: bool
    what: str | None  # checkpoint name, "carry", or None (an unnamed value)


def _body_source(scan_eqn, index: int) -> str | None:
    """What the scan body's output ``index`` is: a checkpoint name, "carry", or None."""
    body = _jc.open_jaxpr(scan_eqn.params["jaxpr"])
    producers = {v: e for e in body.eqns for v in e.outvars}
    v = body.outvars[index]
    while v in producers and producers[v].primitive.name in ("reduce_precision", "device_put"):
        v = producers[v].invars[0]
    if v in producers:
        eqn = producers[v]
        return eqn.params["name"] if eqn.primitive.name == "name" else None
    if v in body.invars:
        num_consts, num_carry = _jc.scan_counts(scan_eqn)
        i = body.invars.index(v) - num_consts
        return "carry" if 0 <= i < num_carry else "xs"
    return None


def stacked_residuals(loss, *args) -> list[Stacked]:
    """The residuals of ``loss``'s VJP that a scan stacks over the ``L`` layers."""
    jaxpr = jax.make_jaxpr(lambda *a: jax.vjp(loss, *a)[1])(*args).jaxpr
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    out = []
    for v in jaxpr.outvars:
        eqn = producers.get(v) if _jc.is_var(v) else None
        if eqn is None or eqn.primitive.name != "scan" or v.aval.shape[:1] != (L,):
            continue
        out.append(
            Stacked(
                shape=tuple(v.aval.shape[1:]),
                dtype=str(v.aval.dtype),
                host=_jc.is_host(v.aval),
                what=_body_source(eqn, eqn.outvars.index(v)),
            )
        )
    return out


def residuals_of(scan_name: str, policy) -> list[Stacked]:
    return stacked_residuals(make_loss(SCANS[scan_name], policy), *abstract_args())


def shapes(res: list[Stacked], host: bool | None = None) -> collections.Counter:
    return collections.Counter(r.shape for r in res if host is None or r.host == host)


def layouts(res: list[Stacked], host: bool | None = None) -> collections.Counter:
    """Shapes up to a transpose (jaxmem.scan may stack x and recompute x.T cheaply)."""
    return collections.Counter(
        tuple(sorted(r.shape)) for r in res if host is None or r.host == host
    )


def whats(res: list[Stacked]) -> collections.Counter:
    return collections.Counter(r.what for r in res)


# ------------------------------------------------------------------------------------------
# Semantics, structurally.


def test_the_listing_sees_names_carries_and_host_memory():
    # The helper itself: jax's own policy, its names traced back through the scan body.
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=["qkv_proj"],
        names_which_can_be_offloaded=["mlp_in"],
        offload_src="device",
        offload_dst="pinned_host",
    )
    res = residuals_of("lax.scan", policy)
    assert sorted((r.what, r.shape, r.host) for r in res) == [
        ("carry", CARRY, False),
        ("mlp_in", MLP, True),
        ("qkv_proj", QKV, False),
    ]


@pytest.mark.parametrize("scan", SCANS)
def test_nothing_saves_only_the_layer_input(scan):
    res = residuals_of(scan, policies.nothing)
    assert shapes(res) == {CARRY: 1}
    assert not any(r.host for r in res)
    if scan == "lax.scan":
        assert whats(res) == {"carry": 1}


@pytest.mark.parametrize("scan", SCANS)
def test_save_saves_exactly_the_named_tensor(scan):
    res = residuals_of(scan, policies.save("qkv_proj"))
    assert shapes(res) == {CARRY: 1, QKV: 1}
    assert not any(r.host for r in res)
    if scan == "lax.scan":
        assert whats(res) == {"carry": 1, "qkv_proj": 1}


@pytest.mark.parametrize("scan", SCANS)
def test_offload_moves_the_named_tensor_to_host(scan):
    # Offloading the layer input moves the carry stack itself to host (nothing left on device).
    res = residuals_of(scan, policies.offload("decoder_layer_input"))
    assert shapes(res, host=True) == {CARRY: 1}
    assert shapes(res, host=False) == {}
    if scan == "lax.scan":
        assert whats(res) == {"decoder_layer_input": 1}


@pytest.mark.parametrize("scan", SCANS)
def test_custom_honours_each_entry(scan):
    policy = policies.custom({"qkv_proj": "device", "attention_out": "offload", "mlp_in": "remat"})
    res = residuals_of(scan, policy)
    assert shapes(res, host=False) == {CARRY: 1, QKV: 1}  # device entry + the carry
    assert shapes(res, host=True) == {ATTN_OUT: 1}  # offload entry
    assert MLP not in shapes(res)  # remat entry (and default remat: nothing else)
    if scan == "lax.scan":
        assert sorted((r.what, r.host) for r in res) == [
            ("attention_out", True),
            ("carry", False),
            ("qkv_proj", False),
        ]


def test_custom_default_applies_to_everything_unnamed():
    # default="device" keeps what `everything` keeps, except the offloaded entry goes to host.
    res = residuals_of("lax.scan", policies.custom({"attention_out": "offload"}, default="device"))
    ref = residuals_of("lax.scan", policies.everything)
    assert [r for r in res if r.host] == [Stacked(ATTN_OUT, "float32", True, "attention_out")]
    assert len(res) == len(ref)
    assert shapes(res, host=False) + shapes(res, host=True) == shapes(ref)


@pytest.mark.parametrize("scan", SCANS)
def test_selective_recomputes_the_attention_core(scan):
    res = residuals_of(scan, policies.selective())
    # No [b, a, s, s] tensor in any layout (jaxmem.scan may stack a transpose).
    assert not [r for r in res if sorted(r.shape) == sorted(CORE)]
    assert not any(r.host for r in res)
    if scan == "lax.scan":
        assert whats(res) == {
            n: 1
            for n in (
                "decoder_layer_input",
                "qkv_proj",
                "attention_out",
                "out_proj",
                "mlp_in",
                "mlp_act",
            )
        }
    # Contrast: without recomputation the core is stacked, so the check above can fail.
    assert [r for r in residuals_of(scan, policies.everything) if r.shape == CORE]


def test_selective_can_recompute_more():
    res = residuals_of("lax.scan", policies.selective(also_recompute=["mlp_act"]))
    assert "mlp_act" not in whats(res) and whats(res)["mlp_in"] == 1


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize(
    "ours, theirs",
    [
        (policies.nothing, jax.checkpoint_policies.nothing_saveable),
        (policies.everything, jax.checkpoint_policies.everything_saveable),
        (policies.dots, jax.checkpoint_policies.dots_saveable),
        (policies.dots_no_batch, jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
    ],
    ids=["nothing", "everything", "dots", "dots_no_batch"],
)
def test_presets_behave_as_jax(scan, ours, theirs):
    args = abstract_args()

    def listing(policy):  # as a multiset: jaxmem.scan's stacking order is its own
        return sorted(
            (r.aval.str_short(), r.description)
            for r in saved_residuals(make_loss(SCANS[scan], policy), *args)
        )

    assert listing(ours) == listing(theirs)


@pytest.mark.parametrize("name", ["nothing", "dots", "dots_saveable", "selective"])
def test_scan_takes_preset_names(name):
    """``jaxmem.scan(policy="dots")`` saves what the policy object saves (one resolver)."""
    args = abstract_args()

    def listing(policy):
        return sorted(
            (r.aval.str_short(), r.description)
            for r in saved_residuals(make_loss(_jaxmem_scan, policy), *args)
        )

    assert listing(name) == listing(policies.by_name(name))
    scanned = jaxmem.scanned(_step, policy=name)
    assert jax.grad(lambda h, ps: jnp.sum(scanned(h, ps)[0]))(*concrete_args()).shape == CARRY


@pytest.mark.parametrize(
    "api",
    [
        lambda p: jaxmem.scan(lambda c, x: (c, None), jnp.ones(2), length=2, policy=p),
        lambda p: jaxmem.scanned(lambda c, x: (c, None), policy=p)(jnp.ones(2), length=2),
        lambda p: jaxmem.reversible_scan(
            lambda w, x: x * w,
            lambda w, x: x * w,
            (jnp.ones(2), jnp.ones(2)),
            jnp.ones((3, 2)),
            policy=p,
        ),
    ],
    ids=["scan", "scanned", "reversible_scan"],
)
def test_bad_policies_get_one_message_everywhere(api):
    with pytest.raises(ValueError, match="unknown policy 'full'; known policies: nothing"):
        api("full")
    with pytest.raises(TypeError, match=r"got policy=3 \(int\); expected None, 'auto'"):
        api(3)


@pytest.mark.parametrize("scan", SCANS)
def test_offload_wins_in_either(scan):
    res = residuals_of(scan, policies.selective() | policies.offload("decoder_layer_input"))
    assert shapes(res, host=True) == {CARRY: 1}
    assert not [r for r in res if sorted(r.shape) == sorted(CORE)]
    if scan == "lax.scan":
        assert [r.what for r in res if r.host] == ["decoder_layer_input"]
        assert whats(res)["qkv_proj"] == 1 and whats(res)["mlp_act"] == 1


def test_either_is_the_union_of_what_is_saved():
    res = residuals_of("lax.scan", policies.save("qkv_proj") | policies.save("mlp_in"))
    assert whats(res) == {"carry": 1, "qkv_proj": 1, "mlp_in": 1}
    # Any remat policy takes part, e.g. one of jax's (through __ror__).
    combined = jax.checkpoint_policies.nothing_saveable | policies.save("mlp_in")
    assert isinstance(combined, policies.Either)
    assert whats(residuals_of("lax.scan", combined)) == {"carry": 1, "mlp_in": 1}


def test_user_names_are_allowed_when_asked_for():
    def f(x):
        return jnp.sin(name(jnp.sin(x), "my_value", allow_unknown=True))

    policy = policies.save("my_value", allow_unknown=True)
    srcs = [r.description for r in saved_residuals(jax.checkpoint(f, policy=policy), 1.0)]
    assert any("named 'my_value'" in s for s in srcs)


# ------------------------------------------------------------------------------------------
# Gradients: every policy computes the no-policy gradient.


GRADIENT_POLICIES = {
    "nothing": policies.nothing,
    "everything": policies.everything,
    "dots": policies.dots,
    "dots_no_batch": policies.dots_no_batch,
    "save": policies.save("qkv_proj", "mlp_act"),
    "offload": policies.offload("decoder_layer_input", "mlp_in"),
    "custom": policies.custom(
        {"qkv_proj": "device", "attention_out": "offload", "mlp_act": "remat"}
    ),
    "custom_default_device": policies.custom({"mlp_in": "offload"}, default="device"),
    "selective": policies.selective(),
    "either": policies.dots_no_batch | policies.offload("decoder_layer_input"),
}


# jaxmem.scan applies the policy as jax.checkpoint inside its own VJP: the name-selecting and
# offloading policies are the ones worth checking there too.
GRADIENT_CASES = [("lax.scan", k) for k in GRADIENT_POLICIES] + [
    ("jaxmem.scan", k) for k in ("nothing", "offload", "custom", "selective", "either")
]


@functools.cache
def all_gradients():
    """The no-policy gradient and every case's, from one compilation (compiling dominates)."""

    def grads(h, ps):
        def grad(scan, policy):
            return jax.grad(make_loss(SCANS[scan], policy), argnums=(0, 1))(h, ps)

        cases = {case: grad(case[0], GRADIENT_POLICIES[case[1]]) for case in GRADIENT_CASES}
        return grad("lax.scan", None), cases

    return jax.jit(grads, compiler_options=FAST_COMPILE)(*concrete_args())


@pytest.mark.parametrize("case", GRADIENT_CASES, ids=["-".join(c) for c in GRADIENT_CASES])
def test_gradient_equals_the_no_policy_gradient(case):
    ref, grads = all_gradients()
    pairs = zip(jax.tree_util.tree_leaves_with_path(grads[case]), jax.tree.leaves(ref), strict=True)
    for (path, g), r in pairs:
        scale = float(jnp.max(jnp.abs(r)))
        np.testing.assert_allclose(
            g, r, rtol=1e-6, atol=1e-6 * scale, err_msg=jax.tree_util.keystr(path)
        )


# ------------------------------------------------------------------------------------------
# Value semantics: hashable, equal by value, printable, static arguments of jit.


def test_policies_are_values():
    assert policies.save("qkv_proj", "mlp_in") == policies.save("mlp_in", "qkv_proj", "mlp_in")
    assert hash(policies.save("qkv_proj", "mlp_in")) == hash(policies.save("mlp_in", "qkv_proj"))
    assert policies.save("qkv_proj") != policies.offload("qkv_proj")
    assert policies.custom({"qkv_proj": "device"}) == policies.custom(device=["qkv_proj"])
    assert policies.selective() == policies.by_name("selective")
    assert policies.dots | policies.save("mlp_in") == policies.either(
        policies.dots, policies.save("mlp_in")
    )
    assert policies.either(policies.dots, policies.dots | policies.dots) is policies.dots
    everything = [*GRADIENT_POLICIES.values(), policies.selective(also_recompute=["mlp_act"])]
    assert len(set(everything)) == len(everything)
    for p in everything:
        with pytest.raises(dataclasses.FrozenInstanceError):
            p.foo = 1  # frozen


def test_policies_print_as_the_call_that_builds_them():
    assert repr(policies.nothing) == "nothing"
    assert repr(policies.dots_no_batch) == "dots_no_batch"
    assert repr(policies.save("qkv_proj", "mlp_in")) == "save('mlp_in', 'qkv_proj')"
    assert repr(policies.offload("decoder_layer_input")) == "offload('decoder_layer_input')"
    assert (
        repr(policies.custom({"qkv_proj": "device"}, offload=["mlp_in"]))
        == "custom({'mlp_in': 'offload', 'qkv_proj': 'device'}, default='remat')"
    )
    assert repr(policies.selective()) == "selective()"
    combined = jax.checkpoint_policies.dots_saveable | policies.selective()
    # jax's own policy: DotsSaveable(...) on jax 0.10, the function's dotted name on 0.12.
    text = repr(combined)
    assert text.startswith("either(") and text.endswith(", selective())")
    assert "dots" in text.lower()
    # Round trip: the repr evaluates back to an equal policy.
    for p in GRADIENT_POLICIES.values():
        assert eval(repr(p), vars(policies)) == p  # noqa: S307 - our own reprs


def test_policies_are_static_arguments_of_jit():
    traces = []

    @functools.partial(jax.jit, static_argnums=1)
    def g(x, policy):
        traces.append(policy)

        def f(x):
            return jnp.sum(jnp.sin(name(jnp.sin(x), "mlp_act")))

        return jax.grad(jax.checkpoint(f, policy=policy))(x)

    x = jnp.arange(3.0)
    a = g(x, policies.save("mlp_act"))
    b = g(x, policies.save("mlp_act"))  # a new, equal policy: no retrace
    c = g(x, policies.selective())
    assert len(traces) == 2
    np.testing.assert_allclose(a, b)
    np.testing.assert_allclose(a, c, rtol=1e-6)


# ------------------------------------------------------------------------------------------
# Errors.


def test_unknown_names_list_the_vocabulary():
    for build in (
        lambda: policies.save("mlpwi"),
        lambda: policies.offload("mlpwi"),
        lambda: policies.custom({"mlpwi": "device"}),
        lambda: policies.custom(remat=["mlpwi"]),
        lambda: policies.selective(also_recompute=["mlpwi"]),
    ):
        with pytest.raises(ValueError, match="unknown checkpoint name 'mlpwi'") as info:
            build()
        assert all(n in str(info.value) for n in NAMES)
        assert "allow_unknown=True" in str(info.value)
    assert policies.custom({"mlpwi": "device"}, allow_unknown=True).explicit_actions() == {
        "mlpwi": "device"
    }
    with pytest.raises(TypeError, match="must be a str"):
        policies.save(["qkv_proj"])
    with pytest.raises(TypeError, match="collection of names, got the str"):
        policies.custom(device="qkv_proj")


def test_overlapping_names_are_refused():
    with pytest.raises(ValueError, match="'qkv_proj' is given two actions"):
        policies.custom({"qkv_proj": "device"}, offload=["qkv_proj"])
    with pytest.raises(ValueError, match="'mlp_in' is given two actions"):
        policies.custom(device=["mlp_in"], remat=["mlp_in"])
    with pytest.raises(ValueError, match="'qkv_proj' is saved on the device by save"):
        policies.save("qkv_proj") | policies.offload("qkv_proj")
    with pytest.raises(ValueError, match="offloaded by"):
        policies.either(policies.custom({"mlp_in": "offload"}), policies.save("mlp_in", "qkv_proj"))
    # One name, one action, given twice: fine.
    assert policies.save("qkv_proj") | policies.custom({"qkv_proj": "device"})


def test_bad_custom_values_are_refused():
    with pytest.raises(ValueError, match=r"mapping\['qkv_proj'\] is 'save'; expected one of"):
        policies.custom({"qkv_proj": "save"})
    with pytest.raises(ValueError, match="default='host'; expected one of"):
        policies.custom({"qkv_proj": "device"}, default="host")
    with pytest.raises(ValueError, match="'remat' entries \\['mlp_in'\\] have no effect"):
        policies.custom({"mlp_in": "remat"}, default="device")
    with pytest.raises(TypeError, match="mapping must be a dict"):
        policies.custom([("qkv_proj", "device")])


def test_by_name():
    assert policies.by_name("nothing") is policies.nothing
    assert policies.by_name("dots_with_no_batch_dims_saveable") is policies.dots_no_batch
    with pytest.raises(ValueError, match="unknown policy 'full'; known policies: ") as info:
        policies.by_name("full")
    for known in ("nothing", "everything", "dots", "dots_no_batch", "selective"):
        assert known in str(info.value)
    with pytest.raises(TypeError, match="policy_name must be a str"):
        policies.by_name(policies.dots)


def test_either_checks_its_arguments():
    with pytest.raises(TypeError, match="at least one policy"):
        policies.either()
    with pytest.raises(TypeError, match=r"policies\[1\] is str"):
        policies.either(policies.dots, "dots")

    @dataclasses.dataclass  # eq without frozen: unhashable
    class Unhashable:
        def __call__(self, *_, **__):
            return False

    with pytest.raises(TypeError, match="not hashable"):
        policies.either(policies.dots, Unhashable())

    bad = policies.either(policies.dots, lambda *_, **__: "yes")
    with pytest.raises(TypeError, match="returned 'yes'"):
        jax.grad(jax.checkpoint(jnp.sin, policy=bad))(1.0)


def test_offload_is_supported_here_without_a_warning():
    # XLA:CPU reports a pinned_host memory; any fallback warning would be an error here.
    assert policies_src._offload_supported()


def test_unsupported_offload_warns_once_and_saves_on_device(monkeypatch):
    monkeypatch.setattr(policies_src, "_offload_supported", lambda: False)
    monkeypatch.setattr(checks, "_WARNED", checks._WARNED - {policies_src.OFFLOAD_FALLBACK})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Policies used nowhere else: JAX caches partial evaluation per (jaxpr, policy).
        first = residuals_of("lax.scan", policies.offload("decoder_layer_input", "out_proj"))
        second = residuals_of("jaxmem.scan", policies.custom({"attention_out": "offload"}))
    fallbacks = [w for w in caught if issubclass(w.category, policies.OffloadFallbackWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in caught]
    message = str(fallbacks[0].message)
    assert "pinned_host" in message and "saved on the device" in message
    assert not any(r.host for r in first + second)
    assert whats(first)["decoder_layer_input"] == 1
    assert layouts(second) == {tuple(sorted(CARRY)): 1, tuple(sorted(ATTN_OUT)): 1}


# ------------------------------------------------------------------------------------------
# What a remat recomputes from loop invariants stays in jaxmem's backward loop.


def _rope_step(positions):
    """A step whose remat recomputes a table of sines from loop-invariant integer positions."""

    def step(h, w):
        angles = positions[:, None] * jnp.exp(-jnp.arange(16.0))[None]  # [T, 16] from [T] ints
        u = jnp.tanh(h @ w) * jnp.sin(angles).sum(-1, keepdims=True)
        return u + h * jnp.cos(angles).mean(-1, keepdims=True), None

    return step


def _backward_barriers(step, h0, ws, policy):
    loss = lambda h0, ws: jnp.sum(jaxmem.scan(step, h0, ws, policy=policy)[0] ** 2)
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(h0, ws)
    from jaxmem._src.scan.jaxprs import iter_eqns  # noqa: PLC0415

    return sum(e.primitive.name == "optimization_barrier" for e in iter_eqns(jaxpr.jaxpr))


def test_remat_of_loop_invariants_stays_in_the_backward_loop():
    """With a policy, the positions (a loop-invariant residual) pass a barrier with the
    loop-carried cotangent in each backward step: XLA cannot hoist the sines computed from them
    out of the loop (and keep them alive through it), as jax.checkpoint's prevent_cse keeps
    them in a stock remat. Without a policy there is no recompute, so no barrier; a float
    residual read as it is (nothing larger computed from it alone) is not pinned either: the
    barrier would only copy it into every step. Gradients equal lax.scan's."""
    r = np.random.default_rng(0)
    h0 = jnp.asarray(r.standard_normal((64, 8)), jnp.float32)
    ws = jnp.asarray(r.standard_normal((5, 8, 8)) / 3, jnp.float32)
    step = _rope_step(jnp.arange(64))
    assert _backward_barriers(step, h0, ws, "nothing") >= 1
    assert _backward_barriers(step, h0, ws, None) == 0
    bias = jnp.asarray(r.standard_normal((64, 8)), jnp.float32)
    assert _backward_barriers(lambda h, w: (jnp.tanh(h @ w) + bias, None), h0, ws, "nothing") == 0

    def grads(scan, **kw):
        loss = lambda h0, ws: jnp.sum(scan(step, h0, ws, **kw)[0] ** 2)
        return jax.grad(loss, argnums=(0, 1))(h0, ws)

    for g, w in zip(grads(jaxmem.scan, policy="nothing"), grads(jax.lax.scan), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))


def test_a_user_remat_pins_invariants_as_its_prevent_cse_says():
    """A step under the user's own ``jax.checkpoint``: with ``prevent_cse=True`` (its default)
    the positions pass the barrier, as they do under jaxmem's ``policy=``; with
    ``prevent_cse=False`` (Flax's ``nn.remat(..., prevent_cse=False)``, as MaxText's scanned
    layers) they do not, and the backward loop computes the table once, outside the loop, as
    ``lax.scan``'s does (pinned, MaxText's llama2 under full remat compiled to 1.004x stock's
    temp). The gradients equal ``lax.scan``'s either way."""
    r = np.random.default_rng(1)
    h0 = jnp.asarray(r.standard_normal((64, 8)), jnp.float32)
    ws = jnp.asarray(r.standard_normal((5, 8, 8)) / 3, jnp.float32)
    step = _rope_step(jnp.arange(64))
    for prevent_cse, pinned in ((True, True), (False, False)):
        user = jax.checkpoint(step, prevent_cse=prevent_cse)
        assert (_backward_barriers(user, h0, ws, None) >= 1) == pinned, prevent_cse

        def grads(scan, user=user):
            loss = lambda h0, ws: jnp.sum(scan(user, h0, ws)[0] ** 2)
            return jax.jit(jax.grad(loss, argnums=(0, 1)))(h0, ws)

        for g, w in zip(grads(jaxmem.scan), grads(jax.lax.scan), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))
